//! The redo record of an in-place commit: what it holds, its seal, and the
//! checks that it can be trusted before anything is written from it.

use super::*;

/// The redo record of one file's in-place commit, in the staging folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InPlaceRecord {
    pub folder: PathBuf,
    pub name: String,
    /// The file as it was (identity, length, time).
    pub before: FileStat,
    /// Its length prefix then (a GGUF file: its header's length less 8):
    /// the old header is its first `8 + old_prefix` bytes.
    #[serde(default)]
    pub old_prefix: u64,
    /// Its first 8 bytes as a little-endian number, when they are not that
    /// length (a GGUF file's magic and version): what a step that fails
    /// after the marker, before anything else changed, puts back (else
    /// `old_prefix`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_start: Option<u64>,
    pub after_len: u64,
    /// The modification time the commit gives the file when done, so that
    /// the journal's `Landing` knows the new version in advance.
    pub after_mtime: (i64, i64),
    /// The file (in the staging folder) holding the new prefix and header.
    pub header_file: String,
    /// Bytes inserted at the start (FALLOC_FL_INSERT_RANGE) before the
    /// writes, whose offsets count them. Once the insertion is durable,
    /// `<header_file>.inserted` says so in the staging folder.
    #[serde(default)]
    pub inserted: u64,
    /// The header's bytes to write, from the start (0: all): the rest is spaces already.
    #[serde(default)]
    pub header_write: u64,
    /// Where those bytes start (0 or 8: after the first 8 bytes, which go
    /// in last): the bytes before it are the same in the old header.
    #[serde(default)]
    pub header_from: u64,
    /// The new header's length when its file holds only what is written
    /// (its first 8 bytes, then `header_from..header_write`): the rest is
    /// the file's own bytes, which the commit does not change (0: the file
    /// holds the whole header). A template edit of a file with a large
    /// vocabulary records kilobytes, not the vocabulary.
    #[serde(default)]
    pub header_len: u64,
    pub writes: Vec<RangeWrite>,
    /// SHA-256 (hex) of the file's first `8 + old_prefix` bytes before the
    /// commit (its old header): a file whose time changed but whose old
    /// header is intact and unmarked is one the commit had not yet changed
    /// (its first write's new time reached the disk, its bytes did not).
    #[serde(default)]
    pub old_header_sum: String,
    /// SHA-256 (hex) of the record (with this field empty) and of its header
    /// file: a record changed or cut short since it was made is not applied.
    #[serde(default)]
    pub sum: String,
}

impl InPlaceRecord {
    pub(super) fn digest(&self, header: &[u8]) -> String {
        let unsealed = InPlaceRecord {
            sum: String::new(),
            ..self.clone()
        };
        sha256_hex(&[&serde_json::to_vec(&unsealed).unwrap_or_default(), header])
    }

    /// Whether `file` still begins with the old header the record names.
    pub(super) fn old_header_intact(&self, file: &File) -> bool {
        if self.old_header_sum.is_empty() {
            return false;
        }
        let mut old = vec![0u8; (PREFIX_LEN + self.old_prefix) as usize];
        file.read_exact_at(&mut old, 0).is_ok() && sha256_hex(&[&old]) == self.old_header_sum
    }

    /// Seals the record with its header (`sum`: of the record and of what
    /// its header file holds, so that it is checked before anything else
    /// is read).
    pub fn seal(&mut self, header: &[u8]) {
        self.sum = self.digest(&self.stored_header(header));
    }

    /// What the header file holds of `header` (see `header_len`).
    pub fn stored_header(&self, header: &[u8]) -> Vec<u8> {
        match self.header_len {
            0 => header.to_vec(),
            _ => {
                let (from, end) = (self.header_from as usize, self.header_write as usize);
                [&header[..PREFIX_LEN as usize], &header[from..end]].concat()
            }
        }
    }

    /// The whole header from what its file holds and the file's own bytes
    /// (checked by the record's sum before anything uses it).
    pub(super) fn whole_header(&self, stored: Vec<u8>, file: &File) -> std::io::Result<Vec<u8>> {
        if self.header_len == 0 {
            return Ok(stored);
        }
        let bad = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a header file of another length",
            )
        };
        let (from, end) = (self.header_from as usize, self.header_write as usize);
        let len = self.header_len as usize;
        if from < PREFIX_LEN as usize
            || from > end
            || end > len
            || stored.len() != PREFIX_LEN as usize + end - from
        {
            return Err(bad());
        }
        let mut header = vec![0u8; len];
        file.read_exact_at(&mut header, 0)?;
        header[..PREFIX_LEN as usize].copy_from_slice(&stored[..PREFIX_LEN as usize]);
        header[from..end].copy_from_slice(&stored[PREFIX_LEN as usize..]);
        Ok(header)
    }

    /// Why the record cannot be applied to a file of `len` bytes now, if it
    /// cannot: its sum, the new header against the new length, every range
    /// within the file and its staging file. Checked before anything is
    /// written, so a record that does not hold leaves the file as it is
    /// (by recovery, and by a commit before it applies its own).
    pub(crate) fn check(
        &self,
        header: &[u8],
        len: u64,
        staged_len: &dyn Fn(&str) -> std::io::Result<u64>,
    ) -> Result<(), BadRecord> {
        if self.sum != self.digest(&self.stored_header(header)) {
            let why = "its checksum does not match: changed or cut short since it was made";
            return Err(BadRecord(why.into()));
        }
        let parsed = Header::parse_any_prefix(header, self.after_len).map_err(|e| {
            BadRecord(format!(
                "its new header is not valid for the new length: {e}"
            ))
        })?;
        let header_end = header.len() as u64;
        if parsed.data_start() != header_end
            || self.header_write > header_end
            || self.header_from > self.header_write.max(PREFIX_LEN)
        {
            return Err(BadRecord(
                "its new header's length disagrees with its data".into(),
            ));
        }
        // The old bytes end here once the insertion is done; appends, then
        // the cut, take the file to its new length.
        let old_end = self.before.len + self.inserted;
        let (low, high) = (
            self.before.len.min(self.after_len),
            old_end.max(self.after_len),
        );
        if len < low || len > high {
            return Err(BadRecord(format!(
                "the file is {len} bytes, which no step of this commit leaves (from {} to {})",
                self.before.len, self.after_len
            )));
        }
        // Copies within the file read old data that no write of the commit
        // changes, so that doing them again reads the same (a copy from the
        // range the cut removes is durable before the cut, and not done
        // again after it).
        let old_data = self.inserted + PREFIX_LEN + self.old_prefix;
        let written: Vec<(u64, u64)> = self
            .writes
            .iter()
            .map(|w| (w.at, w.at.saturating_add(w.len)))
            .collect();
        for w in &self.writes {
            let end =
                w.at.checked_add(w.len)
                    .ok_or_else(|| BadRecord("a range past any file".into()))?;
            if w.at < header_end || end > self.after_len {
                return Err(BadRecord(format!(
                    "a write of {} bytes at {} falls outside the new data section ({header_end}..{})",
                    w.len, w.at, self.after_len
                )));
            }
            match &w.from {
                WriteFrom::Here { offset } => {
                    let from_end = offset
                        .checked_add(w.len)
                        .ok_or_else(|| BadRecord("a range past any file".into()))?;
                    let outside = *offset < old_data.max(header_end) || from_end > old_end;
                    if outside || written.iter().any(|&(a, b)| *offset < b && a < from_end) {
                        return Err(BadRecord(format!(
                            "a copy of {} bytes from {offset} reads outside the old data the commit keeps",
                            w.len
                        )));
                    }
                }
                WriteFrom::Zeros => {}
                WriteFrom::Staged { file, offset } => {
                    if file.contains('/') || file.is_empty() || file == "." || file == ".." {
                        return Err(BadRecord(format!(
                            "{file:?} is not a plain name of a staging file"
                        )));
                    }
                    let have = staged_len(file)
                        .map_err(|e| BadRecord(format!("its staging file {file}: {e}")))?;
                    if offset.checked_add(w.len).is_none_or(|end| have < end) {
                        return Err(BadRecord(format!(
                            "its staging file {file} holds {have} bytes, not the {} it writes from {offset}",
                            w.len
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

/// SHA-256 of the parts, in hex.
pub fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    parts.iter().for_each(|p| ctx.update(p));
    ctx.finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
