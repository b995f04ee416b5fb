//! The mount table as /proc/self/mountinfo gives it: one parser for the
//! daemon (the mount's device number) and the client (the mount's source).

use std::path::{Path, PathBuf};

/// One mount, its text fields unescaped.
pub struct Mount {
    /// "major:minor".
    pub device: String,
    pub point: PathBuf,
    pub fstype: String,
    /// The mount's source: for a stfs mount, its fsname (the checkpoint path).
    pub source: String,
}

/// Every mount, oldest first (the last one on a path is the visible one).
pub fn mounts() -> Vec<Mount> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().filter_map(parse_line).collect()
}

/// `id parent major:minor root point options [optional...] - fstype source super-options`.
fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let left: Vec<&str> = left.split(' ').collect();
    let mut right = right.split(' ');
    Some(Mount {
        device: left.get(2)?.to_string(),
        point: PathBuf::from(unescape(left.get(4)?)),
        fstype: right.next()?.to_string(),
        source: unescape(right.next()?),
    })
}

/// The kernel writes space, tab, newline and backslash as octal escapes.
fn unescape(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// The newest mount on exactly `mount_point`. Only its parent is resolved: a
/// stat of the mount point itself would be a request to the filesystem there,
/// which a daemon that does not serve yet would never answer.
pub fn mount_at(mount_point: &Path) -> Option<Mount> {
    let point = std::fs::canonicalize(mount_point.parent()?)
        .ok()?
        .join(mount_point.file_name()?);
    mounts().into_iter().rev().find(|m| m.point == point)
}

/// The newest mount holding `path` (a mount point or anything inside it).
pub fn mount_holding(path: &Path) -> Option<Mount> {
    let path = std::fs::canonicalize(path).ok()?;
    mounts()
        .into_iter()
        .rev()
        .find(|m| path.starts_with(&m.point))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_escaped_fields() {
        let line = r"36 35 0:39 / /mnt/my\040w rw,nosuid shared:1 - fuse /ckpt/a\040b.safetensors rw,user_id=0";
        let m = parse_line(line).unwrap();
        assert_eq!(m.device, "0:39");
        assert_eq!(m.point, PathBuf::from("/mnt/my w"));
        assert_eq!(
            (m.fstype.as_str(), m.source.as_str()),
            ("fuse", "/ckpt/a b.safetensors")
        );
        assert!(parse_line("garbage").is_none());
    }
}
