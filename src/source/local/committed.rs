//! A source after a commit: the file renamed into place, or the same file
//! written in place (its regions retired, its start shifted, its lease of
//! writing begun and ended).

use super::*;

impl SourceFile {
    /// The file a commit just renamed into place: `file` is it (open for
    /// writing too if `writable`), and `header` its already validated header.
    pub fn committed(
        previous: &SourceFile,
        file: File,
        writable: bool,
        header: Header,
        stat: FileStat,
    ) -> std::io::Result<SourceFile> {
        // SAFETY: as in `open`.
        let map = unsafe { Mmap::map(&file) }?;
        let shared = OpenFile::new(map, &stat, watch::Watch::of(&file));
        previous.remade(Arc::new(file), (writable, shared, 0), header, stat)
    }

    /// This file after an in-place commit wrote `header` (validated) and its
    /// data: the same open file, mapped again at its new length. Reads of this
    /// `SourceFile` go on for the ranges the commit left alone.
    pub fn rewritten_in_place(
        &self,
        header: Header,
        stat: FileStat,
    ) -> std::io::Result<SourceFile> {
        let Some(LocalFile {
            file,
            writable,
            shared,
            ..
        }) = self.local_file()
        else {
            return Err(std::io::Error::from_raw_os_error(libc::EROFS));
        };
        // Mapped again at the file's new length, for every `SourceFile` of it.
        let shift = {
            let mut mapping = shared.mapping.write_anyway();
            // SAFETY: as in `open`.
            mapping.map = unsafe { Mmap::map(&**file) }?;
            mapping.shift
        };
        self.remade(
            file.clone(),
            (*writable, shared.clone(), shift),
            header,
            stat,
        )
    }

    /// An in-place commit is about to overwrite or cut `ranges` (the file's
    /// offsets now): reads of them through the `SourceFile`s made so far fail
    /// from now on (the commit made sure none of them is supposed to read them).
    pub fn retire(&self, ranges: Vec<Range<u64>>) {
        if let Some(LocalFile { shared, .. }) = self.local_file() {
            // Taken alone: no read is between its check and its copy.
            let _mapping = shared.mapping.write_anyway();
            let made = shared.made.load(Ordering::SeqCst);
            shared.retired.lock_anyway().push((made, ranges));
        }
    }

    /// An in-place commit grows the header: `len` bytes (whole blocks) are
    /// inserted at the file's start (FALLOC_FL_INSERT_RANGE), while no read
    /// of this file is in flight; reads after it find their bytes `len`
    /// further on.
    pub fn insert_at_start(&self, len: u64) -> std::io::Result<()> {
        self.shift_start(|file| insert_range(file, len), len as i64)
    }

    /// Takes back `insert_at_start(len)` (the blocks for the grown header
    /// could not be had): the bytes move back and are mapped again.
    pub fn collapse_at_start(&self, len: u64) -> std::io::Result<()> {
        self.shift_start(|file| collapse_range(file, len), -(len as i64))
    }

    /// Moves the file's bytes by `by` with `shift` (no read in flight), and
    /// maps it again.
    fn shift_start(
        &self,
        shift: impl FnOnce(&File) -> std::io::Result<()>,
        by: i64,
    ) -> std::io::Result<()> {
        let Some(LocalFile { file, shared, .. }) = self.local_file() else {
            return Err(std::io::Error::from_raw_os_error(libc::EROFS));
        };
        let mut mapping = shared.mapping.write_anyway();
        shift(file)?;
        // The bytes moved: until they are mapped again, no read may go on.
        mapping.shift = mapping.shift.wrapping_add_signed(by);
        // SAFETY: as in `open`.
        match unsafe { Mmap::map(&**file) } {
            Ok(map) => mapping.map = map,
            Err(e) => {
                shared.broken.store(true, Ordering::SeqCst);
                return Err(e);
            }
        }
        Ok(())
    }

    fn remade(
        &self,
        file: Arc<File>,
        access: (bool, Arc<OpenFile>, u64),
        header: Header,
        stat: FileStat,
    ) -> std::io::Result<SourceFile> {
        let Some(LocalFile {
            folder,
            release_after_read,
            ..
        }) = self.local_file()
        else {
            return Err(std::io::Error::from_raw_os_error(libc::EROFS));
        };
        let fresh = SourceFile::assemble(
            self.path.clone(),
            folder.clone(),
            self.name.clone(),
            file,
            access,
            stat,
            header,
        );
        fresh.set_release_after_read(release_after_read.load(Ordering::Relaxed));
        Ok(fresh)
    }

    /// The open file, for an in-place commit: None when it is not open for
    /// writing (a read-only mount, a file the daemon may not write, a remote
    /// object).
    pub fn writable_file(&self) -> Option<&Arc<File>> {
        match self.local_file() {
            Some(LocalFile {
                file,
                writable: true,
                ..
            }) => Some(file),
            _ => None,
        }
    }

    /// An in-place commit starts writing the file: reads go on (they are of
    /// ranges it leaves alone) although the file changes.
    pub fn begin_in_place(&self) {
        if let Some(LocalFile { shared, .. }) = self.local_file() {
            if let Some(w) = &shared.watch {
                w.begin_own();
            }
            shared.writing.store(true, Ordering::SeqCst);
        }
    }

    /// The in-place commit ended: `now` is the version reads accept from now on
    /// (the file as the commit left it, or as it was if it did not start).
    pub fn end_in_place(&self, now: Option<&FileStat>) {
        if let Some(LocalFile { shared, .. }) = self.local_file() {
            if let Some(now) = now {
                *shared.accepted.lock_anyway() = (now.len, now.mtime);
            }
            if let Some(w) = &shared.watch {
                w.end_own(now.is_some());
            }
            shared.writing.store(false, Ordering::SeqCst);
        }
    }
}
