//! What `stfs status` shows, and prefetching a tensor.

use super::*;
use crate::sync::LockAnyway;

pub(super) fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

impl Fs {
    /// `stfs status`: staged changes and problems, one line each; true when a
    /// commit would be refused.
    pub fn status(&self) -> (String, bool) {
        let st = self.read_state();
        let held = self.held_bytes(&st);
        let mut out = String::new();
        let mut refused = false;
        if let Some(why) = self.tainted() {
            refused = true;
            out.push_str(&format!("{}\n", CommitError::Tainted { why }));
        }
        for m in &st.checkpoints {
            let s = m.live.status();
            refused |= !s.problems.is_empty();
            let head = match (s.changes.len(), s.problems.len()) {
                (0, 0) => "no changes".to_string(),
                (n, 0) => format!("{n} change{} staged", plural(n)),
                (n, p) => format!(
                    "{n} change{} staged, {p} problem{} (a commit would refuse)",
                    plural(n),
                    plural(p)
                ),
            };
            out.push_str(&format!("{}: {head}\n", s.file.display()));
            if m.live
                .source()
                .remote_object()
                .is_some_and(|r| r.replaced())
            {
                out.push_str(
                    "  replaced   the object changed behind the mount: its reads fail (EIO); mount it again\n",
                );
            }
            for line in &s.changes {
                out.push_str(&format!("  {line}\n"));
            }
            for p in &s.problems {
                out.push_str(&format!("  problem    {p}\n"));
            }
            if let Some(way) = m
                .live
                .commit_preview(&held)
                .filter(|_| !s.changes.is_empty())
            {
                out.push_str(&format!("  commit     {way}\n"));
            }
        }
        let across = st.in_two_shards();
        if let (Some((folder, _)), false) = (&st.folder, across.is_empty()) {
            refused = true;
            let n = across.len();
            out.push_str(&format!(
                "{}: {n} problem{} across shards (a commit would refuse)\n",
                folder.path.display(),
                plural(n)
            ));
            for p in across {
                out.push_str(&format!("  problem    {p}\n"));
            }
        }
        out.push_str(&format!(
            "served {} read{} of tensor bytes ({} bytes) since mounted\n",
            self.reads.load(Ordering::Relaxed),
            plural(self.reads.load(Ordering::Relaxed) as usize),
            self.read_bytes.load(Ordering::Relaxed)
        ));
        // The shards of a remote folder share one connection and cache.
        if let Some(remote) = st
            .checkpoints
            .first()
            .and_then(|m| m.live.source().remote_object())
        {
            out.push_str(&format!("{}\n", remote.remote().summary()));
        }
        (out, refused)
    }

    /// Prefetches the tensor of an open data file; a CUDA buffer lives until
    /// the handle closes. Stops early (returning where) when `keep_going` says so.
    pub fn prefetch(
        &self,
        ino: Ino,
        fh: u64,
        req: PrefetchRequest,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<Prefetched, FsError> {
        let PrefetchRequest {
            target,
            offset,
            len,
            caller,
        } = req;
        self.allowed(caller, "prefetch")?;
        let object = match self.handles.lock_anyway().open.get(&fh) {
            Some(Handle::Data { object, .. }) => Some(object.clone()),
            _ => None,
        };
        // (The handles' lock is released here: the state comes first in the lock order.)
        let Some(object) = object else {
            return match self.read_state().node(ino)? {
                Node::File(_, _, TensorFile::Data) => Err(FsError::Invalid(
                    "prefetch needs an open tensor file".into(),
                )),
                _ => Err(FsError::NotATensor),
            };
        };
        let (dtype, shape) = {
            let st = self.read_state();
            let meta = st.home(&object).and_then(|c| {
                st.live(c)
                    .entry(object.home().1)
                    .filter(|e| e.data.is_some())
                    .map(|e| e.meta.to_owned())
            });
            match meta {
                Some(crate::checkpoint::Meta::Valid { dtype, shape }) => (Some(dtype), Some(shape)),
                _ => (None, None),
            }
        };
        let bytes = object.bytes();
        let nbytes = bytes.len();
        let mut done = Prefetched {
            bytes: 0,
            nbytes,
            next: nbytes,
            dtype,
            shape,
            ipc: None,
        };
        let Some(backing) = bytes.backing()? else {
            return Ok(done);
        };
        match target {
            PrefetchTarget::PageCache => {
                let start = offset.min(nbytes);
                let end = match len {
                    0 => nbytes,
                    n => start.saturating_add(n).min(nbytes),
                };
                let (reached, resident) =
                    crate::prefetch::to_page_cache(&backing, start, end, keep_going)?;
                done.next = reached;
                done.bytes = resident;
            }
            PrefetchTarget::Cuda(device) => {
                let buffer = crate::prefetch::cuda::to_device(device, &backing, keep_going)?;
                done.bytes = nbytes;
                done.ipc = Some((buffer.ipc_handle, buffer.len() as u64));
                if let Some(Handle::Data { device, .. }) =
                    self.handles.lock_anyway().open.get_mut(&fh)
                {
                    device.push(buffer);
                }
            }
        }
        Ok(done)
    }
}
