//! A local checkpoint opened: through its folder's descriptor, refused
//! unless a regular file, mapped read-only and validated.

use super::*;

impl SourceFile {
    /// Opens, maps and validates a checkpoint. A symbolic link is followed to
    /// the file it names; commits replace that file and keep the link.
    pub fn open(path: &Path) -> Result<SourceFile, SourceError> {
        SourceFile::open_with(path, false)
    }

    /// `open`, with the file opened for writing too when `writable` and the
    /// file allows it (so that commits may write it in place; the mapping
    /// stays read-only). Falls back to read-only.
    pub fn open_with(path: &Path, writable: bool) -> Result<SourceFile, SourceError> {
        let io = |source| SourceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let path = std::path::absolute(path).map_err(io)?;
        let real = std::fs::canonicalize(&path).map_err(io)?;
        let (dir, name) = match (real.parent(), real.file_name()) {
            (Some(d), Some(n)) => (d, n.to_os_string()),
            _ => return Err(SourceError::NotRegular { path }),
        };
        let folder = Arc::new(Folder::open(dir).map_err(io)?);
        let flags = 0;
        let (file, writable) = match writable {
            true => match folder.open_file(&name, libc::O_RDWR | flags, 0) {
                Ok(f) => (f, true),
                // (Another user's file, a read-only filesystem: commits rewrite it.)
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::ETXTBSY)
                    ) =>
                {
                    (
                        folder
                            .open_file(&name, libc::O_RDONLY | flags, 0)
                            .map_err(io)?,
                        false,
                    )
                }
                Err(e) => return Err(io(e)),
            },
            false => (
                folder
                    .open_file(&name, libc::O_RDONLY | flags, 0)
                    .map_err(io)?,
                false,
            ),
        };
        let stat = FileStat::of(&file).map_err(io)?;
        if stat.mode & libc::S_IFMT != libc::S_IFREG {
            return Err(SourceError::NotRegular { path });
        }
        // (Before its bytes are read: a write while they are is seen too.)
        let watch = watch::Watch::of(&file);
        let format = |error| SourceError::Format {
            path: path.clone(),
            error,
        };
        // A `.gguf` file is read as GGUF (and refused as one) whatever it holds.
        let named_gguf = crate::format::gguf::named_gguf(&name);
        if stat.len < 8 && !named_gguf {
            return Err(format(FormatError::TooShort { file_len: stat.len }));
        }
        // SAFETY: the mapping is read-only. stfs writes the source in place
        // only in ranges no reader of this mapping is given (in-place commits,
        // checkpoint::in_place); another program that does is detected
        // before each read (`check_unchanged`), and the bytes are only
        // ever read by the kernel on stfs's behalf, where a page that vanished
        // gives EFAULT, never SIGBUS.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let read_at = |b: &mut [u8], p: u64| {
            let p = (p as usize).min(map.len());
            let n = b.len().min(map.len() - p);
            b[..n].copy_from_slice(&map[p..p + n]);
            Ok(n)
        };
        if crate::format::interrupted_in_place(map.len() as u64, read_at) {
            return Err(SourceError::Interrupted { path });
        }
        let header = crate::format::read_checkpoint(&map, &name).map_err(format)?;
        let shared = OpenFile::new(map, &stat, watch);
        Ok(SourceFile::assemble(
            path,
            folder,
            name,
            Arc::new(file),
            (writable, shared, 0),
            stat,
            header,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn assemble(
        path: PathBuf,
        folder: Arc<Folder>,
        name: OsString,
        file: Arc<File>,
        (writable, shared, shift_base): (bool, Arc<OpenFile>, u64),
        stat: FileStat,
        header: Header,
    ) -> SourceFile {
        // The header's pages were read once, to parse: they need not stay in
        // the daemon's resident memory.
        {
            let mapping = shared.mapping();
            let header_end = ((mapping.shift - shift_base + header.data_start()) as usize)
                .min(mapping.map.len());
            if header_end > 0 {
                // SAFETY: read-only shared file mapping; a later access faults the
                // same bytes back in from the page cache.
                let _ = unsafe {
                    mapping
                        .map
                        .unchecked_advise_range(UncheckedAdvice::DontNeed, 0, header_end)
                };
            }
        }
        SourceFile {
            gguf_shown: Default::default(),
            path,
            name,
            stat,
            header,
            store: Box::new(LocalFile {
                folder,
                file,
                shift_base,
                made: shared.made.fetch_add(1, Ordering::SeqCst),
                release_after_read: AtomicBool::new(false),
                writable,
                shared,
                warned_stale: AtomicBool::new(false),
            }),
        }
    }
}
