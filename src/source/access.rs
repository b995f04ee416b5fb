//! Who may read a source, as the source is now: its owner, group and mode,
//! narrowed by a POSIX ACL (which the kernel does not apply to a FUSE file's
//! attributes), and combined for a view that draws on several files. And the
//! metadata a rewrite must carry over to the new file (xattrs, ACLs).

use std::ffi::CString;
use std::fs::File;

use crate::source::FileStat;

const ACL_XATTR: &str = "system.posix_acl_access";

// Tags of the kernel's xattr form of an ACL (linux/posix_acl_xattr.h).
const ACL_USER_OBJ: u16 = 0x01;
const ACL_USER: u16 = 0x02;
const ACL_GROUP_OBJ: u16 = 0x04;
const ACL_GROUP: u16 = 0x08;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;

/// The file's owner, group and permission bits now (`fallback`'s when it
/// cannot be asked), with the group and other bits narrowed by its ACL.
pub fn owner_now(file: &File, fallback: &FileStat) -> FileStat {
    let Ok(now) = FileStat::of(file) else {
        return *fallback;
    };
    let mode = match get_xattr(file, ACL_XATTR) {
        Some(acl) => narrow_by_acl(now.mode, &acl),
        None => now.mode,
    };
    FileStat {
        mode,
        uid: now.uid,
        gid: now.gid,
        ..*fallback
    }
}

/// Mode bits under which nobody who is not the owner gets more through the
/// mount than the ACL gives them: the mount's kernel checks only the owner,
/// group and other bits, so a named user or group gets the group's or the
/// other bits there, and those are cut to the least any of them may.
pub fn narrow_by_acl(mode: u32, acl: &[u8]) -> u32 {
    if acl.len() < 4 || (acl.len() - 4) % 8 != 0 {
        return mode & !0o077; // not understood: the owner only
    }
    let (mut group_obj, mut mask, mut other) = (7u32, None, 7u32);
    let mut named = Vec::new();
    for e in acl[4..].chunks_exact(8) {
        let tag = u16::from_le_bytes([e[0], e[1]]);
        let perm = u16::from_le_bytes([e[2], e[3]]) as u32 & 7;
        match tag {
            ACL_USER_OBJ => {}
            ACL_GROUP_OBJ => group_obj = perm,
            ACL_MASK => mask = Some(perm),
            ACL_OTHER => other = perm,
            ACL_USER => named.push((true, perm)),
            ACL_GROUP => named.push((false, perm)),
            _ => return mode & !0o077,
        }
    }
    let Some(mask) = mask else {
        return mode; // a minimal ACL is the mode itself
    };
    // With a mask, the mode's group bits are the mask: the owning group gets
    // group_obj & mask, which may be less (`g::---,m::rw`).
    // A member of the owning group may be a named user instead.
    let users = named
        .iter()
        .filter(|(user, _)| *user)
        .fold(7, |acc, (_, p)| acc & p & mask);
    let all_named = named.iter().fold(7, |acc, (_, p)| acc & p & mask);
    let group = group_obj & mask & users;
    let other = other & all_named;
    (mode & !0o077) | (group << 3) | other
}

/// Permission bits that no reader of any of `stats` gets more than (for a
/// view drawing on all of them), shown with the first one's owner and group.
pub fn narrowest(stats: &[FileStat]) -> Option<FileStat> {
    let (first, rest) = stats.split_first()?;
    let bits = |m: u32, shift: u32| (m >> shift) & 7;
    let (mut u, mut g, mut o) = (
        bits(first.mode, 6),
        bits(first.mode, 3),
        bits(first.mode, 0),
    );
    for s in rest {
        let (su, sg, so) = (bits(s.mode, 6), bits(s.mode, 3), bits(s.mode, 0));
        let same_user = s.uid == first.uid;
        let same_group = s.gid == first.gid;
        // What each class of the first file may meet in this one, at least.
        u &= if same_user { su } else { sg & so };
        g &= match (same_group, same_user) {
            (true, true) => sg,
            (true, false) => sg & su,
            (false, _) => sg & so & su,
        };
        o &= so & if same_user { 7 } else { su } & if same_group { 7 } else { sg };
    }
    Some(FileStat {
        mode: (first.mode & !0o777) | (u << 6) | (g << 3) | o,
        ..*first
    })
}

fn get_xattr(file: &File, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        match rustix::fs::fgetxattr(file, name, &mut buf[..]) {
            Ok(n) => {
                buf.truncate(n);
                return Some(buf);
            }
            Err(rustix::io::Errno::RANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Err(_) => return None, // none (ENODATA), or a filesystem without xattrs
        }
    }
}

fn list_xattrs(file: &File) -> Vec<CString> {
    let mut buf = vec![0u8; 1024];
    loop {
        match rustix::fs::flistxattr(file, &mut buf[..]) {
            Ok(n) => {
                buf.truncate(n);
                break;
            }
            Err(rustix::io::Errno::RANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Err(_) => return Vec::new(),
        }
    }
    buf.split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .filter_map(|n| CString::new(n).ok())
        .collect()
}

/// Copies every extended attribute of `from` that this process may set onto
/// `to`: user attributes, POSIX ACLs (`system.posix_acl_access`), security
/// labels and, as root, trusted ones. Returns the names it could not copy
/// (the caller says so), each with why.
pub fn copy_xattrs(from: &File, to: &File) -> Vec<String> {
    let mut missed = Vec::new();
    for name in list_xattrs(from) {
        let shown = name.to_string_lossy().into_owned();
        // File capabilities are not carried to new content (the kernel drops
        // them on any write too).
        if shown == "security.capability" {
            continue;
        }
        let Some(value) = get_xattr(from, &shown) else {
            continue;
        };
        let flags = rustix::fs::XattrFlags::empty();
        if let Err(e) = rustix::fs::fsetxattr(to, name.as_c_str(), &value, flags) {
            missed.push(format!("{shown} ({})", std::io::Error::from(e)));
        }
    }
    missed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        let mut v = 2u32.to_le_bytes().to_vec();
        for &(tag, perm, id) in entries {
            v.extend_from_slice(&tag.to_le_bytes());
            v.extend_from_slice(&perm.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    #[test]
    fn an_acl_narrows_what_the_group_and_others_are_shown() {
        // group::--- with a named user r-- (mask r--): mode shows g=r, but a
        // member of the owning group may not read.
        let a = acl(&[
            (ACL_USER_OBJ, 6, u32::MAX),
            (ACL_USER, 4, 1234),
            (ACL_GROUP_OBJ, 0, u32::MAX),
            (ACL_MASK, 4, u32::MAX),
            (ACL_OTHER, 4, u32::MAX),
        ]);
        assert_eq!(narrow_by_acl(0o100644, &a) & 0o7777, 0o604);
        // A named user denied while others may read: others are shown nothing.
        let a = acl(&[
            (ACL_USER_OBJ, 6, u32::MAX),
            (ACL_USER, 0, 1234),
            (ACL_GROUP_OBJ, 4, u32::MAX),
            (ACL_MASK, 4, u32::MAX),
            (ACL_OTHER, 4, u32::MAX),
        ]);
        assert_eq!(narrow_by_acl(0o100644, &a) & 0o7777, 0o600);
        // A minimal ACL is the mode.
        let a = acl(&[
            (ACL_USER_OBJ, 6, 0),
            (ACL_GROUP_OBJ, 4, 0),
            (ACL_OTHER, 4, 0),
        ]);
        assert_eq!(narrow_by_acl(0o100644, &a) & 0o7777, 0o644);
        // A mask and no named entry: the mode shows the mask (g=rw), the
        // owning group gets group_obj & mask (nothing).
        let a = acl(&[
            (ACL_USER_OBJ, 6, 0),
            (ACL_GROUP_OBJ, 0, 0),
            (ACL_MASK, 6, 0),
            (ACL_OTHER, 0, 0),
        ]);
        assert_eq!(narrow_by_acl(0o100660, &a) & 0o7777, 0o600);
        // An entry of a kind not known: the owner only.
        let a = acl(&[(ACL_USER_OBJ, 6, 0), (0x40, 4, 0), (ACL_OTHER, 4, 0)]);
        assert_eq!(narrow_by_acl(0o100644, &a) & 0o7777, 0o600);
        // Not understood: the owner only.
        assert_eq!(narrow_by_acl(0o100644, b"xx") & 0o7777, 0o600);
    }

    #[test]
    fn extended_attributes_are_copied_whatever_their_size() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"x").unwrap();
        std::fs::write(&b, b"y").unwrap();
        let from = File::open(&a).unwrap();
        let big = vec![7u8; 3000];
        let set = |name: &str, value: &[u8]| {
            rustix::fs::fsetxattr(&from, name, value, rustix::fs::XattrFlags::empty())
        };
        if set("user.big", &big).is_err() {
            return; // a filesystem without user xattrs
        }
        set("user.small", b"s").unwrap();
        let to = std::fs::OpenOptions::new().write(true).open(&b).unwrap();
        assert!(copy_xattrs(&from, &to).is_empty());
        assert_eq!(get_xattr(&to, "user.big").unwrap(), big);
        assert_eq!(get_xattr(&to, "user.small").unwrap(), b"s");
    }

    #[test]
    fn a_view_of_several_files_is_readable_by_those_who_may_read_them_all() {
        let st = |mode, uid, gid| FileStat {
            dev: 0,
            ino: 0,
            len: 0,
            mtime: (0, 0),
            mode,
            uid,
            gid,
        };
        let n = |s: &[FileStat]| narrowest(s).unwrap().mode & 0o777;
        assert_eq!(n(&[st(0o644, 1, 1), st(0o600, 1, 1)]), 0o600);
        assert_eq!(n(&[st(0o644, 1, 1), st(0o640, 1, 1)]), 0o640);
        // Another owner: the first's owner gets only what anyone gets there.
        assert_eq!(n(&[st(0o644, 1, 1), st(0o644, 2, 2)]), 0o444);
        assert_eq!(n(&[st(0o644, 1, 1), st(0o600, 2, 1)]), 0o000);
        assert_eq!(n(&[st(0o644, 1, 1)]), 0o644);
    }
}
