//! Command-line interface.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::format::Metadata;

/// The description of stfs(1): what a mount shows and what a commit does
/// (docs/SEMANTICS.md has every rule).
const LONG_ABOUT: &str = "\
A safetensors or GGUF checkpoint as a directory of tensor files.

THE MOUNT. `stfs mount FILE MNT` shows the checkpoint as a directory: one file per \
tensor holding its raw bytes (served from the source's page cache), NAME.meta.json \
({\"dtype\", \"shape\", \"data_offsets\", ...}) beside it, and __metadata__.json (the \
header's metadata map). `stfs mount DIR MNT` of a folder of shards shows one directory \
per *.safetensors file, its *.index.json, and a model folder's other files \
(config.json, the tokenizer's, README.md; read-only). An s3:// object or prefix, or an \
https:// URL, mounts the same way. Files show the source's owner, group and mode.

EDITS. Any tool edits the mount: write a tensor file (in place, or a new file renamed \
over it), rm, mv, cp, create a tensor with its .meta.json, write a .meta.json (dtype, \
shape, name) or __metadata__.json. Edits are staged in a private folder beside the \
source (journaled: a crash keeps them, the next mount takes them back) and the source \
is untouched until a commit. `stfs status MNT` lists them and what a commit would \
refuse.

COMMITS. `stfs commit MNT` writes the staged edits into the source: in place when the \
edit allows (a metadata edit or a same-size overwrite of a 100 GB file writes \
kilobytes), else by writing a new file and renaming it over the source; all shards of \
a folder land together or none do. A killed commit leaves the original file (or one \
every reader refuses until the next mount completes it) and the staged edits. \
`stfs discard MNT` drops them; `stfs umount MNT` commits, then unmounts (with \
--discard it drops them instead).

VIEWS. MNT/__views__/ (reached by name, not listed) holds read-only files computed \
from the staged state: model.safetensors (the checkpoint as a commit would write it), \
bf16/, f16/, f32/ (every float tensor cast), npy/NAME.npy, reshard/SIZE/ (split as \
save_pretrained splits), and for a folder of shards each shard, merged.safetensors and \
the index; a model folder's views hold its config (naming the cast's dtype) and \
tokenizer, so `cp -r MNT/__views__/bf16 out/` exports a whole model.

GGUF. A .gguf file mounts the same way; its keys are MNT/__kv__/KEY files (a value as \
text: edit it with any editor) and __metadata__.json lists them all.

LOADING. `stfs prefetch MNT` brings tensors into the page cache; \
`stfs prefetch --device cuda:N MNT` and the Python package's stfs.cuda.load_all load \
every tensor into one device allocation through a pool of pinned slabs.";

/// How `inspect` and `verify` reach a URL.
#[derive(clap::Args)]
struct UrlArgs {
    /// An S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS).
    #[arg(long, value_name = "URL", help_heading = "Remote sources")]
    endpoint: Option<String>,
    /// Seconds before a server that does not answer is given up.
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_seconds, help_heading = "Remote sources")]
    timeout: std::time::Duration,
}

impl From<UrlArgs> for crate::inspect::UrlOptions {
    fn from(a: UrlArgs) -> Self {
        crate::inspect::UrlOptions {
            endpoint: a.endpoint,
            timeout: a.timeout,
        }
    }
}

#[derive(Parser)]
#[command(
    name = "stfs",
    version,
    about = "A safetensors or GGUF checkpoint as a directory of tensor files",
    long_about = LONG_ABOUT
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per run: the size of the mount's variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// List a checkpoint's header without mounting it (a file, or a URL).
    Inspect {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        url: UrlArgs,
        /// A .safetensors or .gguf file, or a URL (s3://, https://, gs://, az://).
        #[arg(value_hint = clap::ValueHint::FilePath)]
        file: PathBuf,
    },
    /// Validate checkpoints (files, folders of shards with their index, URLs
    /// of objects or of S3 prefixes); exit 0 only if all are valid.
    Verify {
        #[command(flatten)]
        url: UrlArgs,
        #[arg(required = true, value_hint = clap::ValueHint::AnyPath)]
        paths: Vec<PathBuf>,
    },
    /// Mount a checkpoint file, or a folder of shards, as a directory of tensor files.
    Mount {
        /// Stay in the foreground (logs go to stderr unless --log-file); unmount on Ctrl-C.
        #[arg(short)]
        f: bool,
        /// Mount options, comma-separated, repeatable: ro, rw, allow_other,
        /// allow_root, nonempty, cache=direct|keep (direct, the default: one copy
        /// in memory; keep: the mount's own page cache too), mapping=keep|release
        /// (the daemon's page-table references to the source after a read),
        /// load_slabs=N, load_slab_kib=K (the pool of pinned slabs each device's
        /// loads share: 8 of 16 MiB), load_idle_s=N (the pool is freed after N
        /// seconds with no load, 300; 0: kept until unmount), noexec, noatime, nodev, nosuid,
        /// default_permissions (always on).
        #[arg(short = 'o', value_name = "OPTIONS", value_parser = crate::daemon::check_options)]
        options: Vec<String>,
        /// Worker threads serving requests (default: number of CPUs, 2 to 8).
        #[arg(long)]
        threads: Option<usize>,
        /// Log file of the daemon (default: ~/.local/state/stfs/stfs.log, else
        /// $XDG_RUNTIME_DIR/stfs/stfs.log or /var/tmp/stfs-UID/stfs.log; stderr with -f).
        #[arg(long, value_hint = clap::ValueHint::FilePath)]
        log_file: Option<PathBuf>,
        /// Write the daemon's pid here while it runs.
        #[arg(long, value_hint = clap::ValueHint::FilePath)]
        pid_file: Option<PathBuf>,
        /// Where staging folders go (default: beside the source).
        #[arg(long, value_name = "DIR", value_hint = clap::ValueHint::DirPath, help_heading = "Local sources (edits)")]
        staging_dir: Option<PathBuf>,
        /// Take back the edits kept in this staging folder (by default the newest
        /// kept edits of the source that still apply are taken back).
        #[arg(
            long,
            value_name = "DIR",
            conflicts_with = "no_resume",
            help_heading = "Local sources (edits)"
        )]
        resume: Option<PathBuf>,
        /// Do not take back kept edits; they stay on disk.
        #[arg(long, help_heading = "Local sources (edits)")]
        no_resume: bool,
        /// An S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS).
        #[arg(long, value_name = "URL", help_heading = "Remote sources")]
        endpoint: Option<String>,
        /// Ranged GETs in flight at once.
        #[arg(
            long,
            value_name = "N",
            default_value_t = 16,
            help_heading = "Remote sources"
        )]
        concurrency: usize,
        /// Seconds before a read whose server does not answer fails (EIO); a
        /// header is fetched within 4 times that in all.
        #[arg(
            long,
            value_name = "SECONDS",
            default_value = "30",
            value_parser = parse_seconds,
            help_heading = "Remote sources"
        )]
        timeout: std::time::Duration,
        /// The local cache of fetched bytes (default: $XDG_CACHE_HOME/stfs, else ~/.cache/stfs).
        #[arg(long, value_name = "DIR", value_hint = clap::ValueHint::DirPath, help_heading = "Remote cache")]
        cache_dir: Option<PathBuf>,
        /// The cache's size; least recently used chunks go past it (K, M, G, T suffixes).
        #[arg(
            long,
            value_name = "SIZE",
            default_value = "10G",
            value_parser = parse_size,
            help_heading = "Remote cache"
        )]
        cache_size: u64,
        /// A .safetensors or .gguf file, a folder of them (with *.index.json; the
        /// parts of a split GGUF file), or a URL: s3://bucket/key.safetensors,
        /// s3://bucket/prefix/ (a folder of shards), https://host/path.safetensors,
        /// gs://, az:// (GGUF objects read-only).
        #[arg(value_hint = clap::ValueHint::AnyPath)]
        source: PathBuf,
        /// An empty folder: the checkpoint's directory (a folder of shards: one
        /// directory per shard in it).
        #[arg(value_hint = clap::ValueHint::DirPath)]
        mountpoint: PathBuf,
    },
    /// Commit staged edits, then unmount.
    Umount {
        /// Detach now, finish when the last open file is closed.
        #[arg(short = 'l', long)]
        lazy: bool,
        /// Drop the staged edits instead of committing them.
        #[arg(long)]
        discard: bool,
        #[arg(value_hint = clap::ValueHint::DirPath)]
        mountpoint: PathBuf,
    },
    /// List the staged edits of a mount and what a commit would refuse (exit 1 then).
    Status {
        /// Print JSON (files, changes, problems, the way the next commit takes).
        #[arg(long)]
        json: bool,
        /// The mount point, or any path inside it.
        #[arg(value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
    },
    /// Write the staged edits of a mount into its source file, atomically.
    Commit {
        /// Commit even if the source was changed behind the mount.
        #[arg(long)]
        force: bool,
        /// Rewrite the file exactly as the reference's save_file lays it out
        /// (never in place; no room left in the header for later edits).
        #[arg(long)]
        compact: bool,
        /// The mount point, or a checkpoint directory or file inside it.
        #[arg(value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
    },
    /// Drop the staged edits of a mount; it stays mounted and shows its source again.
    Discard {
        /// The mount point, or a checkpoint directory or file inside it.
        #[arg(value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
    },
    /// Bring tensors of a mount into the page cache (cpu), or load them into
    /// CUDA device memory in one load and say how fast (cuda:N: a folder is
    /// every tensor of its mount).
    Prefetch {
        /// cpu (the page cache), cuda:N, or host (the load pipeline into the
        /// daemon's memory: for tests and benchmarks).
        #[arg(long, default_value = "cpu", value_parser = crate::client::parse_device)]
        device: crate::client::Device,
        /// Tensor files, or directories of them.
        #[arg(required = true, value_hint = clap::ValueHint::AnyPath)]
        paths: Vec<PathBuf>,
    },
    /// Print a shell's completion script (bash: save it as
    /// ~/.local/share/bash-completion/completions/stfs).
    Completions { shell: clap_complete::Shell },
    /// Print the man page stfs(1), or, with --out-dir DIR, write stfs.1 and
    /// a page per command (stfs-mount.1, ...) into DIR.
    Man {
        /// Write the pages into this folder instead (for example
        /// ~/.local/share/man/man1).
        #[arg(long, value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        out_dir: Option<PathBuf>,
    },
    /// Write an empty, valid checkpoint.
    Create {
        #[arg(value_hint = clap::ValueHint::FilePath)]
        file: PathBuf,
        /// A metadata entry; repeat for more.
        #[arg(long = "metadata", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        metadata: Vec<(String, String)>,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
    },
}

/// Seconds, from 0.1 to a day.
fn parse_seconds(s: &str) -> Result<std::time::Duration, crate::errno::Failure> {
    match s.trim().parse::<f64>() {
        Ok(n) if (0.1..=86400.0).contains(&n) => Ok(std::time::Duration::from_secs_f64(n)),
        _ => Err(format!("{s:?}: seconds from 0.1 to 86400").into()),
    }
}

/// A size in bytes, with an optional K, M, G or T suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, crate::errno::Failure> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{s:?}: the suffix must be K, M, G or T").into()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size (like 512M or 20G)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large").into())
}

fn parse_key_value(s: &str) -> Result<(String, String), crate::errno::Failure> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE").into())
}

/// The man pages, from the same definitions as the command line: stfs(1) on
/// `out`, or stfs.1 and stfs-COMMAND.1 written into `dir`.
fn man_pages(
    dir: Option<&std::path::Path>,
    out: &mut dyn std::io::Write,
) -> Result<(), crate::errno::Failure> {
    let cmd = Cli::command();
    let Some(dir) = dir else {
        return clap_mangen::Man::new(cmd)
            .render(out)
            .map_err(|e| format!("writing the man page: {e}").into());
    };
    let write = |name: String, page: clap::Command| {
        let path = dir.join(format!("{name}.1"));
        let mut text = Vec::new();
        clap_mangen::Man::new(page.name(name.clone()))
            .render(&mut text)
            .and_then(|()| std::fs::write(&path, text))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for sub in cmd.get_subcommands() {
        write(format!("stfs-{}", sub.get_name()), sub.clone())?;
    }
    write("stfs".into(), cmd)?;
    println!("man pages written into {}", dir.display());
    Ok(())
}

/// Paths in messages are absolute.
fn absolute(p: PathBuf) -> PathBuf {
    std::path::absolute(&p).unwrap_or(p)
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // A command whose reader went away (`stfs status | head -1`) ends as any
    // shell tool does, by SIGPIPE, not by a panic of println!. Not the
    // daemon: a reader of what it writes may go, and it must serve on.
    if !matches!(cli.command, Command::Mount { .. }) {
        // SAFETY: restoring a signal's default action, before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let stdout = &mut std::io::stdout().lock();
    let result = match cli.command {
        Command::Inspect { json, url, file } => {
            crate::inspect::inspect(&file, &url.into(), json, stdout)
        }
        Command::Verify { url, paths } => match crate::inspect::verify(&paths, &url.into(), stdout)
        {
            0 => Ok(()),
            n => Err(format!("{n} problem{} found", if n == 1 { "" } else { "s" }).into()),
        },
        mount @ Command::Mount { .. } => crate::daemon::mount(mount_request(mount)),
        Command::Umount {
            lazy,
            discard,
            mountpoint,
        } => crate::client::umount(&absolute(mountpoint), lazy, discard)
            .map(|lines| lines.iter().for_each(|l| println!("{l}"))),
        Command::Status { json, path } => match status(json, &absolute(path)) {
            Ok(true) => return ExitCode::FAILURE,
            Ok(false) => Ok(()),
            Err(e) => Err(e),
        },
        Command::Commit {
            force,
            compact,
            path,
        } => {
            let mut flags = 0;
            if force {
                flags |= crate::fs::ioctl::COMMIT_FORCE;
            }
            if compact {
                flags |= crate::fs::ioctl::COMMIT_COMPACT;
            }
            crate::client::commit(&absolute(path), flags)
                .map(|message| println!("{message}"))
                .map_err(crate::errno::Failure::from)
        }
        Command::Discard { path } => {
            crate::client::commit(&absolute(path), crate::fs::ioctl::COMMIT_DISCARD)
                .map(|message| println!("{message}"))
                .map_err(crate::errno::Failure::from)
        }
        Command::Prefetch { device, paths } => prefetch(device, paths),
        Command::Create {
            file,
            metadata,
            force,
        } => {
            let metadata =
                (!metadata.is_empty()).then(|| metadata.into_iter().collect::<Metadata>());
            crate::create::create(&file, metadata, force)
        }
        Command::Completions { shell } => completions(shell, stdout),
        Command::Man { out_dir } => man_pages(out_dir.as_deref(), stdout),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stfs: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What `stfs mount` was asked for, as the daemon takes it.
fn mount_request(command: Command) -> crate::daemon::MountRequest {
    let Command::Mount {
        f,
        options,
        threads,
        log_file,
        pid_file,
        staging_dir,
        resume,
        no_resume,
        endpoint,
        cache_dir,
        cache_size,
        concurrency,
        timeout,
        source,
        mountpoint,
    } = command
    else {
        unreachable!("a mount request is made of `stfs mount`")
    };
    crate::daemon::MountRequest {
        remote: crate::source::remote::RemoteOptions {
            endpoint,
            cache_dir: cache_dir
                .map(absolute)
                .unwrap_or_else(crate::source::remote::default_cache_dir),
            cache_size,
            concurrency: concurrency.max(1),
            timeout,
        },
        source,
        mountpoint,
        foreground: f,
        options,
        threads,
        log_file,
        pid_file,
        staging_dir,
        resume: match (resume, no_resume) {
            (Some(dir), _) => crate::checkpoint::recover::Resume::Only(
                dir.file_name().unwrap_or_default().to_os_string(),
            ),
            (None, true) => crate::checkpoint::recover::Resume::Never,
            (None, false) => crate::checkpoint::recover::Resume::Auto,
        },
    }
}

/// `stfs status`: the report printed; true when a commit would be refused.
fn status(json: bool, path: &std::path::Path) -> Result<bool, crate::errno::Failure> {
    let (report, refused) = crate::client::status(path, json).map_err(|e| e.to_string())?;
    match json {
        true => println!("{report}"),
        false => print!("{report}"),
    }
    Ok(refused)
}

/// `stfs prefetch`: each tensor file of `paths`, a line each, a bar while it
/// goes; to a device, one load of them all.
fn prefetch(
    device: crate::client::Device,
    paths: Vec<PathBuf>,
) -> Result<(), crate::errno::Failure> {
    let mut failed = 0;
    let paths: Vec<PathBuf> = paths.into_iter().map(absolute).collect();
    if device != crate::client::Device::Cpu {
        return load(device, paths);
    }
    let files = crate::client::tensor_files(&paths);
    let total = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    let bar = crate::progress::bytes(total, "prefetching");
    for path in files {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        bar.set_message(format!("prefetching {name}"));
        let result = crate::client::prefetch(&path, device, &|n| bar.inc(n));
        // Lines go above the bar (printed as they are when no bar is drawn).
        bar.suspend(|| match result {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("stfs: {e}");
                failed += 1;
            }
        });
    }
    crate::progress::clear(bar);
    match failed {
        0 => Ok(()),
        n => Err(format!("{n} prefetch{} failed", if n == 1 { "" } else { "es" }).into()),
    }
}

/// `stfs prefetch --device cuda:N`: a folder is every tensor of its mount;
/// tensor files are loaded by name, one load for each folder they are in.
fn load(device: crate::client::Device, paths: Vec<PathBuf>) -> Result<(), crate::errno::Failure> {
    let mut loads: Vec<(PathBuf, Vec<String>)> = Vec::new();
    for path in paths {
        match (path.is_dir(), path.parent(), path.file_name()) {
            (false, Some(dir), Some(name)) => {
                let name = name.to_string_lossy().into_owned();
                match loads.iter_mut().find(|(d, n)| d == dir && !n.is_empty()) {
                    Some((_, names)) => names.push(name),
                    None => loads.push((dir.to_path_buf(), vec![name])),
                }
            }
            _ => loads.push((path, Vec::new())),
        }
    }
    for (at, names) in loads {
        let bar = crate::progress::bytes(0, "loading");
        let line = crate::client::load(&at, device, &names, &|landed, total| {
            bar.set_length(total);
            bar.set_position(landed);
        });
        crate::progress::clear(bar);
        println!("{}", line?);
    }
    Ok(())
}

/// `stfs completions SHELL`. Bash's script as clap writes it offers the
/// options where a command takes a path, even for an empty word: there it
/// offers nothing instead, and bash completes file names (`-o default`).
fn completions(
    shell: clap_complete::Shell,
    out: &mut dyn std::io::Write,
) -> Result<(), crate::errno::Failure> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "stfs", &mut script);
    if shell == clap_complete::Shell::Bash {
        script = files_for_paths(&String::from_utf8_lossy(&script)).into_bytes();
    }
    out.write_all(&script)?;
    Ok(())
}

/// The subcommands whose arguments are paths.
fn path_commands() -> Vec<String> {
    use clap::ValueHint::{AnyPath, DirPath, FilePath};
    Cli::command()
        .get_subcommands()
        .filter(|c| {
            c.get_positionals()
                .any(|a| matches!(a.get_value_hint(), AnyPath | FilePath | DirPath))
        })
        .map(|c| c.get_name().to_string())
        .collect()
}

/// Bash's script with a word that is not an option left to file-name
/// completion in the blocks of `path_commands`.
fn files_for_paths(script: &str) -> String {
    let paths = path_commands();
    let mut block = String::new();
    let mut out = String::with_capacity(script.len());
    for line in script.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed
            .strip_prefix("stfs__subcmd__")
            .and_then(|r| r.strip_suffix(')'))
        {
            block = name.to_string();
        }
        let in_path_block = paths.contains(&block);
        let replaced = match trimmed {
            "if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then" if in_path_block => {
                line.replace(" || ${COMP_CWORD} -eq 2", "")
            }
            // The block's last answer (the `if` above answers options, deeper).
            r#"COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )"#
                if in_path_block && line.len() - trimmed.len() == 12 =>
            {
                line.replace(r#"( $(compgen -W "${opts}" -- "${cur}") )"#, "()")
            }
            _ => line.to_string(),
        };
        out.push_str(&replaced);
        out.push('\n');
    }
    out
}
