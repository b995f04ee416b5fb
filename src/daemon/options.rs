//! The mount's options: `-o` parsed and checked, and what they set.

use super::*;

/// Parsed `-o` options.
#[derive(Debug, Clone)]
pub(super) struct MountOptions {
    pub(super) read_only: bool,
    pub(super) acl: SessionACL,
    pub(super) nonempty: bool,
    pub(super) cache: CacheMode,
    pub(super) release_after_read: bool,
    pub(super) load_slabs: usize,
    pub(super) load_slab: usize,
    pub(super) load_idle_s: u64,
    pub(super) kernel: Vec<MountOption>,
}

pub(super) const KNOWN: &str = "ro, rw, allow_other, allow_root, nonempty, cache=keep|direct, \
                     mapping=keep|release, load_slabs=N, load_slab_kib=N, load_idle_s=N, default_permissions (always on), nodev, nosuid, \
                     noexec, noatime";

/// Checks one `-o` argument (clap's value parser: a bad option is refused
/// with the command line's usage).
pub fn check_options(arg: &str) -> Result<String, crate::errno::Failure> {
    parse_options(&[arg.to_string()]).map(|_| arg.to_string())
}

pub(super) fn parse_options(list: &[String]) -> Result<MountOptions, crate::errno::Failure> {
    let mut o = MountOptions {
        read_only: false,
        acl: SessionACL::Owner,
        nonempty: false,
        cache: CacheMode::Direct,
        release_after_read: false,
        load_slabs: crate::fs::LOAD_SLABS,
        load_slab: crate::fs::LOAD_SLAB,
        load_idle_s: crate::fs::LOAD_IDLE_S,
        kernel: Vec::new(),
    };
    for opt in list
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        match opt {
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "allow_other" => o.acl = SessionACL::All,
            "allow_root" => o.acl = SessionACL::RootAndOwner,
            "nonempty" => o.nonempty = true,
            "cache=keep" => o.cache = CacheMode::Keep,
            "cache=direct" => o.cache = CacheMode::Direct,
            "mapping=keep" => o.release_after_read = false,
            "mapping=release" => o.release_after_read = true,
            "default_permissions" => {}
            "nodev" | "nosuid" => {}
            "noexec" => o.kernel.push(MountOption::NoExec),
            "noatime" => o.kernel.push(MountOption::NoAtime),
            _ if opt.starts_with("load_slabs=") => o.load_slabs = count(opt, 1..=1024)?,
            _ if opt.starts_with("load_slab_kib=") => {
                o.load_slab = count(opt, 4..=(1 << 20))? << 10
            }
            _ if opt.starts_with("load_idle_s=") => {
                o.load_idle_s = count(opt, 0..=(7 * 24 * 3600))? as u64
            }
            other => return Err(format!("unknown mount option {other:?} (known: {KNOWN})").into()),
        }
    }
    Ok(o)
}

/// The number of `name=N`, in `range`.
fn count(
    opt: &str,
    range: std::ops::RangeInclusive<usize>,
) -> Result<usize, crate::errno::Failure> {
    let (name, n) = opt.split_once('=').expect("name=N");
    match n.parse::<usize>() {
        Ok(n) if range.contains(&n) => Ok(n),
        _ => Err(format!(
            "mount option {name} takes a number from {} to {}, not {n:?}",
            range.start(),
            range.end()
        )
        .into()),
    }
}

pub(super) fn settings(options: &MountOptions) -> Settings {
    Settings {
        read_only: options.read_only,
        owner: rustix::process::getuid().as_raw(),
        cache: options.cache,
        release_after_read: options.release_after_read,
        load_slabs: options.load_slabs,
        load_slab: options.load_slab,
        // (0: kept until unmount.)
        load_idle: (options.load_idle_s > 0)
            .then(|| std::time::Duration::from_secs(options.load_idle_s)),
    }
}

/// `-o` for fusermount3: it adds nosuid and nodev itself.
pub(super) fn fusermount_options(source: &Path, options: &MountOptions) -> String {
    let mut o = vec![
        format!("fsname={}", source.display().to_string().replace(',', "_")),
        "subtype=stfs".into(),
        "default_permissions".into(),
    ];
    o.push(if options.read_only { "ro" } else { "rw" }.into());
    match options.acl {
        SessionACL::All | SessionACL::RootAndOwner => o.push("allow_other".into()),
        SessionACL::Owner => {}
    }
    o.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(opts: &str) -> Result<MountOptions, String> {
        parse_options(&[opts.to_string()]).map_err(|e| e.to_string())
    }

    #[test]
    fn the_load_options_set_the_pool_and_its_idle_time() {
        let o = parsed("load_slabs=3,load_slab_kib=4,load_idle_s=7").unwrap();
        let s = settings(&o);
        assert_eq!((s.load_slabs, s.load_slab), (3, 4096));
        assert_eq!(s.load_idle, Some(std::time::Duration::from_secs(7)));
        assert_eq!(
            settings(&parsed("load_idle_s=0").unwrap()).load_idle,
            None,
            "0: until unmount"
        );
        let default = settings(&parsed("ro").unwrap()).load_idle;
        assert_eq!(
            default,
            Some(std::time::Duration::from_secs(crate::fs::LOAD_IDLE_S))
        );
    }

    #[test]
    fn a_load_option_out_of_range_is_refused_saying_the_range() {
        for bad in [
            "load_idle_s=-1",
            "load_idle_s=",
            "load_idle_s=604801",
            "load_slabs=0",
            "load_slab_kib=1",
        ] {
            let e = parsed(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(e.contains("takes a number from"), "{bad}: {e}");
        }
    }
}
