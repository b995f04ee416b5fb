//! Completing an interrupted in-place commit at the next mount, from its
//! sealed record and header.

use super::*;

impl InPlaceRecord {
    /// After a crash: completes the commit if the file is still the one it
    /// was writing (old, marked, or written but for its time), and says what
    /// it did. `dir` is the staging folder holding the record. An error says
    /// whether the record must stay (the file is still refused by readers).
    /// A record whose seal does not hold tells nothing to trust, not even
    /// which file it names: it is kept, and nothing is done.
    pub fn complete(&self, dir: &Folder) -> Result<Option<String>, (RecoveryError, bool)> {
        let stored = self.sealed_header(dir).map_err(|why| (why, true))?;
        self.try_complete(dir, stored).map_err(|why| {
            let refused = Folder::open(&self.folder)
                .and_then(|f| f.open_file(OsStr::new(&self.name), libc::O_RDONLY, 0))
                .map(|f| {
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    crate::format::interrupted_in_place(len, |b, p| f.read_at(b, p))
                })
                .unwrap_or(false);
            (why, refused)
        })
    }

    /// What the header file holds, if the record's seal holds over it.
    fn sealed_header(&self, dir: &Folder) -> Result<Vec<u8>, RecoveryError> {
        let path = self.folder.join(&self.name);
        let io = |source: std::io::Error| RecoveryError::Io {
            what: format!(
                "{}: reading the record of an interrupted commit",
                path.display()
            ),
            source,
        };
        if self.header_file.contains('/') || self.header_file.is_empty() {
            return Err(RecoveryError::Refused(format!(
                "{}: not a plain name in a redo record",
                path.display()
            )));
        }
        let mut stored = Vec::new();
        let h = dir
            .open_file(OsStr::new(&self.header_file), libc::O_RDONLY, 0)
            .map_err(io)?;
        crate::testpoint::io("read")
            .and_then(|()| std::io::Read::read_to_end(&mut &h, &mut stored))
            .map_err(io)?;
        if self.sum != self.digest(&stored) {
            return Err(RecoveryError::Refused(format!(
                "{}: the record of its interrupted commit does not hold: its checksum does not \
                 match (changed or cut short since it was made); nothing was done, and the record \
                 is kept",
                path.display()
            )));
        }
        Ok(stored)
    }

    fn try_complete(&self, dir: &Folder, stored: Vec<u8>) -> Result<Option<String>, RecoveryError> {
        let path = self.folder.join(&self.name);
        let plain = !self.name.is_empty()
            && !self.name.contains('/')
            && self.name != "."
            && self.name != ".."
            && self.folder.is_absolute()
            && !self.header_file.contains('/');
        if !plain {
            return Err(RecoveryError::Refused(format!(
                "{}: not a plain name in a redo record",
                path.display()
            )));
        }
        let io = |source: std::io::Error| RecoveryError::Io {
            what: format!("{}: completing an interrupted commit", path.display()),
            source,
        };
        let folder = Folder::open(&self.folder).map_err(io)?;
        let file = folder
            .open_file(OsStr::new(&self.name), libc::O_RDWR, 0)
            .map_err(io)?;
        let st = FileStat::of(&file).map_err(io)?;
        if (st.dev, st.ino) != (self.before.dev, self.before.ino) {
            return Err(RecoveryError::Refused(format!(
                "{}: replaced since an in-place commit of it was interrupted: its record is dropped",
                path.display()
            )));
        }
        let marked = crate::format::interrupted_in_place(st.len, |b, p| file.read_at(b, p));
        if !marked && st.len == self.after_len && st.mtime == self.after_mtime {
            return Ok(None); // done before the crash
        }
        let header = stored;
        if header.len() < PREFIX_LEN as usize {
            return Err(RecoveryError::Refused(format!(
                "{}: a redo record without a header",
                path.display()
            )));
        }
        let header = self.whole_header(header, &file).map_err(io)?;
        if header.len() < PREFIX_LEN as usize {
            return Err(RecoveryError::Refused(format!(
                "{}: a redo record without a header",
                path.display()
            )));
        }
        // The whole record is checked before any of it is used.
        let open_staged = |name: &str| -> std::io::Result<Arc<File>> {
            if name.contains('/') {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            Ok(Arc::new(dir.open_file(
                OsStr::new(name),
                libc::O_RDONLY,
                0,
            )?))
        };
        let mut on_disk = vec![0u8; header.len()];
        let got = file.read_at(&mut on_disk, 0).map_err(io)?;
        let started = marked || (st.len, st.mtime) != (self.before.len, self.before.mtime);
        // The old header, intact and unmarked: the marker's write may have
        // reached the disk as a new time without its bytes.
        let old_header = !marked && self.old_header_intact(&file);
        // All written, the prefix too: only the time is missing (its
        // staging files are not needed any more). Not when the new header is
        // the old one (a same-size overwrite): then the data may not be
        // written, and the commit is done again.
        let only_time = !marked
            && started
            && got == header.len()
            && on_disk == header
            && st.len == self.after_len
            && !old_header;
        // Nothing changes the file before its marker: without it and as it
        // was, the commit had not started.
        let unchanged =
            !marked && st.len == self.before.len && (st.mtime == self.before.mtime || old_header);
        let staged_len = |name: &str| -> std::io::Result<u64> {
            match only_time {
                true => Ok(u64::MAX),
                false => Ok(open_staged(name)?
                    .metadata()?
                    .len()
                    .saturating_sub(staged_pad(name))),
            }
        };
        self.check(&header, st.len, &staged_len).map_err(|why| {
            let state = if marked {
                "the file is left as it is (every reader refuses it) and the record is kept"
            } else if unchanged {
                "the file is left as it is (no step of the commit had begun on it)"
            } else {
                "the file is left as it is"
            };
            RecoveryError::Refused(format!(
                "{}: the record of an interrupted in-place commit does not hold ({why}): not \
                 applied; {state} (the record: {})",
                path.display(),
                dir.path.display()
            ))
        })?;
        if only_time {
            self.finish_time(&file).map_err(io)?;
            return Ok(Some(format!(
                "{}: completed a commit that was interrupted (written in place)",
                path.display()
            )));
        }
        if !(marked || unchanged) {
            return Err(RecoveryError::Refused(format!(
                "{}: changed by another program since an in-place commit of it was interrupted: \
                 left as it is, its record is dropped",
                path.display()
            )));
        }
        let insert = |len| crate::source::local::insert_range(&file, len);
        let collapse = |len| crate::source::local::collapse_range(&file, len);
        let steps = Steps {
            open_staged: &open_staged,
            insert: &insert,
            collapse: &collapse,
            dir,
            retire: &|_| {},
            // (A record of a version that did not keep the old prefix cannot put it back.)
            fresh: unchanged && self.old_prefix != 0,
        };
        self.apply(&file, &header, &steps)
            .map_err(|e| io(e.error))?;
        info!(file = %path.display(), "completed an interrupted in-place commit");
        Ok(Some(format!(
            "{}: completed a commit that was interrupted (written in place)",
            path.display()
        )))
    }
}
