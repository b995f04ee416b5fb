//! The ways a commit can take, cheapest first (docs/ARCHITECTURE.md, "The
//! seams"): each plans a new state or says why it cannot.

use super::*;
use crate::checkpoint::Declined;

/// A way's plan for one commit (docs/SEMANTICS.md, "The ways"): it says
/// what it will do, and writes what lands. Each way is one implementation;
/// nothing outside it knows which it is.
pub trait PlannedWay: Send {
    /// What `stfs status` and `stfs commit` say of it.
    fn describe(&self, file_len: u64) -> String;
    /// Whether it writes a new file beside the source (a rewrite, which
    /// `stfs status` checks the folder's room and rights for).
    fn rewrites(&self) -> bool {
        false
    }
    /// Step 2, touching no state: writes what `land` puts in place.
    fn write(
        self: Box<Self>,
        plan: &CommitPlan,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError>;
}

/// The source's own file, changed where it is, under a write lease (none
/// in a preview: `stfs status` changes nothing).
pub(super) struct InPlacePlan {
    layout: InPlaceLayout,
    lease: Option<Lease>,
    file: Arc<File>,
    /// The modification time the file gets when done.
    mtime: (i64, i64),
}

impl PlannedWay for InPlacePlan {
    fn describe(&self, _file_len: u64) -> String {
        format!(
            "{}{}",
            in_place_words(
                &self.layout.summary,
                self.layout.bytes,
                self.layout.shareable
            ),
            match self.lease {
                Some(_) => "",
                None => ", unless another program has the file open then",
            }
        )
    }

    fn write(
        self: Box<Self>,
        plan: &CommitPlan,
        _progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError> {
        let InPlacePlan {
            layout,
            lease,
            file,
            mtime,
        } = *self;
        let source = &plan.source;
        let folder = source.folder().ok_or_else(|| CommitError::ReadOnly {
            file: source.path().to_path_buf(),
        })?;
        // The staging files the redo record names must be durable first:
        // one by one, or (many small ones) the whole filesystem at once.
        let mut staged = std::collections::HashMap::new();
        for (_, k) in &layout.writes {
            if let Some(s) = plan.inputs[*k].staging_file() {
                staged.insert(s.name(), s.clone());
            }
        }
        let what = |source| CommitError::Io {
            what: format!(
                "{}: syncing the staging files",
                plan.source.path().display()
            ),
            source,
        };
        if staged.len() > 64 {
            let any = staged
                .values()
                .next()
                .expect("many")
                .file()
                .map_err(&what)?;
            rustix::fs::syncfs(&*any).map_err(|e| what(e.into()))?;
        } else {
            for s in staged.values() {
                s.sync().map_err(&what)?;
            }
        }
        let old_prefix = source.header().header_len;
        // The file as mapped, with its owner and mode as they are now
        // (set-id bits a write clears are put back from them).
        let now = FileStat::of(&file).map_err(io_err(source.path().display().to_string()))?;
        let stat = FileStat {
            mode: now.mode,
            uid: now.uid,
            gid: now.gid,
            ..*source.stat()
        };
        let mut old_header = vec![0u8; (crate::format::PREFIX_LEN + old_prefix) as usize];
        file.read_exact_at(&mut old_header, 0)
            .map_err(io_err(source.path().display().to_string()))?;
        let mut record = InPlaceRecord {
            folder: folder.path.clone(),
            name: source.file_name().to_string_lossy().into_owned(),
            before: stat,
            old_prefix,
            // (A GGUF file starts with its magic and version, not its length.)
            old_start: source
                .header()
                .is_gguf()
                .then(|| u64::from_le_bytes(old_header[..8].try_into().expect("8 bytes"))),
            after_len: layout.file_len,
            after_mtime: mtime,
            header_file: format!("in-place-{}-{}-{}.header", plan.commit, stat.dev, stat.ino),
            inserted: layout.inserted,
            header_write: layout.header_write,
            header_from: layout.header_from,
            // (Only what is written, when that is not the whole header.)
            header_len: match layout.header_from > crate::format::PREFIX_LEN {
                true => plan.layout.header.len() as u64,
                false => 0,
            },
            writes: layout.writes.iter().map(|(w, _)| w.clone()).collect(),
            old_header_sum: in_place::sha256_hex(&[&old_header]),
            sum: String::new(),
        };
        record.seal(&plan.layout.header);
        Ok(Box::new(InPlaceJob {
            source: source.clone(),
            landed: std::sync::Mutex::new(None),
            file,
            lease: std::sync::Mutex::new(lease),
            header: plan.layout.header.clone(),
            record,
            staged,
            summary: layout.summary,
            bytes: layout.bytes,
            shared: std::sync::atomic::AtomicU64::new(0),
        }))
    }
}

/// A new file renamed over the source; `why`: why not in place. With
/// `sharing` (the block size, the bytes it expects to share): its tensors
/// in the source's order and at the same places within their blocks, so
/// that their blocks are shared with the source's (XFS, btrfs).
pub(super) struct RewritePlan {
    why: String,
    sharing: Option<(u64, u64)>,
}

impl PlannedWay for RewritePlan {
    fn describe(&self, file_len: u64) -> String {
        match self.sharing {
            Some((_, shared)) => format!(
                "by a rewrite that shares extents (not in place: {}; {} written, {} shared with the old file)",
                self.why,
                human_bytes(file_len - shared),
                human_bytes(shared)
            ),
            None => format!(
                "by a rewrite (not in place: {}; {} written)",
                self.why,
                human_bytes(file_len)
            ),
        }
    }

    fn rewrites(&self) -> bool {
        true
    }

    fn write(
        self: Box<Self>,
        plan: &CommitPlan,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError> {
        plan.rewrite(self.sharing.map(|(block, _)| block), progress)
    }
}

/// "in place (header, 1 tensor overwritten; 12.0 KiB copied, 256.0 MiB
/// shared with the staging files)": what an in-place commit writes, the
/// bytes it shares (clones) counted apart from those it copies.
pub fn in_place_words(summary: &str, bytes: u64, shared: u64) -> String {
    match shared {
        0 => format!("in place ({summary}; {} written)", human_bytes(bytes)),
        _ => format!(
            "in place ({summary}; {} copied, {} shared with the staging files)",
            human_bytes(bytes.saturating_sub(shared)),
            human_bytes(shared)
        ),
    }
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{n} bytes"),
        _ => format!("{v:.1} {}", UNITS[u]),
    }
}

/// A modification time after `old` (and now, if the clock allows): the one an
/// in-place commit gives the file, known before it writes.
pub(super) fn new_mtime(old: (i64, i64)) -> (i64, i64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let now = (now.as_secs() as i64, now.subsec_nanos() as i64);
    if now > old {
        now
    } else if old.1 < 999_999_999 {
        (old.0, old.1 + 1)
    } else {
        (old.0 + 1, 0)
    }
}

/// A checkpoint's new state, as the ways of committing see it.
pub struct NewState<'a> {
    pub source: &'a Arc<SourceFile>,
    /// Name, dtype and shape of each tensor; `inputs[k]` holds tensor k's bytes.
    pub specs: &'a [(&'a str, crate::format::Dtype, &'a [u64])],
    pub inputs: &'a [Bytes],
    /// The new state's format, which writes its headers.
    pub format: &'a dyn crate::format::FormatWriter,
    /// A safetensors state's metadata (the remote way writes its header).
    pub metadata: Option<&'a crate::format::Metadata>,
    /// Bytes that open descriptors and the other shards read.
    pub held: &'a [Bytes],
    /// The file at the source's name is still the one mapped.
    pub unchanged: bool,
    pub options: CommitOptions,
    /// The new state laid out as a new file: as the format's reference
    /// writer lays it out with `--compact`, else with room in its header.
    pub reference: Layout,
    /// A plan only to say what a commit would do (`stfs status`): it takes no
    /// lease and changes nothing.
    pub preview: bool,
    /// Where a remote commit records its upload (the staging folder's base,
    /// and the record's name); None in a preview.
    pub upload_record: Option<(Arc<Folder>, String)>,
}

/// A way of committing a checkpoint (docs/ARCHITECTURE.md, "The seams"): its plan for a new state
/// (the new file's layout, and what landing it takes), or why it cannot.
/// `why_not`: why the cheaper ways could not (a rewrite says so).
pub trait CommitWay: Sync {
    fn plan(
        &self,
        new: &NewState,
        why_not: &str,
    ) -> Result<(Layout, Box<dyn PlannedWay>), Declined>;
}

/// The ways, cheapest first: the planner takes the first that can.
pub(super) const WAYS: [&dyn CommitWay; 3] = [&InPlaceWay, &SharedExtentsWay, &RewriteWay];

/// The plan of the first way that can commit `new`; a rewrite says why the
/// cheaper ways could not. (Only a remote commit can fail to plan: an
/// object S3 cannot hold.)
pub(super) fn choose(new: &NewState) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
    // A remote object has one way.
    if new.source.remote_object().is_some() {
        return super::remote::RemoteWay.plan(new, "");
    }
    let mut why_not: Vec<String> = Vec::new();
    for way in WAYS {
        match way.plan(new, &why_not.join("; ")) {
            Ok(plan) => return Ok(plan),
            Err(Declined(why)) if why_not.contains(&why) => {}
            Err(Declined(why)) => why_not.push(why),
        }
    }
    unreachable!("a rewrite can always commit")
}

/// The source's own file, changed where it is (`in_place`).
pub(super) struct InPlaceWay;

impl CommitWay for InPlaceWay {
    fn plan(
        &self,
        new: &NewState,
        _why_not: &str,
    ) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
        if new.options.compact {
            return Err("--compact".into());
        }
        if !new.unchanged {
            return Err("--force over a file that changed".into());
        }
        let source = new.source;
        let file = source
            .writable_file()
            .ok_or("the daemon has it open read-only")?
            .clone();
        use std::os::unix::fs::MetadataExt;
        let links = file.metadata().map_err(|e| e.to_string())?.nlink();
        if links != 1 {
            return Err(format!("it has {links} links").into());
        }
        // A source tensor is held when something besides this commit's own
        // inputs reads it (an open descriptor, another shard, a copy no
        // longer named): the inputs are among `new.held` too (this
        // checkpoint's edited objects), and a renamed tensor, or one read
        // once, is no reason not to move it.
        // (A tensor written in part reads its source tensor too; counted
        // apart, the inputs' own: a descriptor on one reads what it reads.)
        let own_patches: std::collections::HashSet<*const crate::source::Patched> = new
            .inputs
            .iter()
            .filter_map(|b| match b {
                Bytes::Patched(p) => Some(Arc::as_ptr(p)),
                _ => None,
            })
            .collect();
        let mut readers = vec![0i64; source.header().tensors.len()];
        let mut readers_apart = readers.clone();
        let mut count = |bytes: &[Bytes], by: i64| {
            for b in bytes {
                let own = matches!(b, Bytes::Patched(p) if own_patches.contains(&Arc::as_ptr(p)));
                if let Some((_, i)) = b
                    .source_tensor()
                    .filter(|(src, _)| Arc::ptr_eq(src, source))
                {
                    readers[i as usize] += by;
                    if !own {
                        readers_apart[i as usize] += by;
                    }
                }
            }
        };
        count(new.held, 1);
        count(new.inputs, -1);
        let held: Vec<bool> = readers.iter().map(|&n| n > 0).collect();
        let held_apart: Vec<bool> = readers_apart.iter().map(|&n| n > 0).collect();
        let specs = new.specs;
        let layout = in_place::layout(
            source,
            specs.len(),
            |i| specs[i],
            new.inputs,
            new.format,
            &held,
            &held_apart,
            crate::source::local::inserts_blocks(&file),
        )?;
        let mut layout = layout;
        if crate::source::local::shares_extents(&file).is_some() {
            layout.expect_sharing();
        }
        let lease = match new.preview {
            true => None,
            false => Some(Lease::take(&file)?),
        };
        let mtime = new_mtime(source.stat().mtime);
        Ok((
            layout.layout.clone(),
            Box::new(InPlacePlan {
                layout,
                lease,
                file,
                mtime,
            }),
        ))
    }
}

/// A new file whose tensors keep the source's order and their places within
/// their blocks, so that the filesystem shares their blocks (FICLONERANGE):
/// a tensor dropped from the middle costs what the blocks around it cost.
pub(super) struct SharedExtentsWay;

impl CommitWay for SharedExtentsWay {
    fn plan(
        &self,
        new: &NewState,
        why_not: &str,
    ) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
        if new.options.compact {
            return Err("--compact".into());
        }
        let source = new.source;
        let file = source.file().ok_or("a remote source")?;
        let block = crate::source::local::shares_extents(file)
            .ok_or("this filesystem cannot share blocks between files (XFS and btrfs can)")?;
        let data_start_now = source.header().data_start() + source.shift();
        let (kept, order) = source_order(new, false);
        let tensors = tensors_in_order(new, &order)?;
        let refused = |e: crate::format::FormatError| Declined(e.to_string());
        // Room (a quarter of the header again, at least 4 KiB), and the
        // data section at the old one's place within a block.
        let needed = match new.format.header_at(&tensors, 0) {
            Ok((h, _)) => h.len() as u64,
            Err(NoFit::Needs(n)) => n,
            Err(NoFit::Refused(e)) => return Err(refused(e)),
        };
        let base = needed + (needed / 4).max(4096);
        let data_start = base + (data_start_now % block + block - base % block) % block;
        if data_start > crate::format::MAX_HEADER_LEN {
            return Err("the header would pass 100,000,000 bytes".into());
        }
        let header = match new.format.header_at(&tensors, data_start) {
            Ok((h, _)) => h,
            Err(NoFit::Refused(e)) => return Err(refused(e)),
            Err(NoFit::Needs(_)) => return Err("internal: a header does not fit its room".into()),
        };
        let mut shared = 0;
        for (j, &(old_start, _)) in kept.iter().enumerate() {
            let (from, to) = (
                data_start_now + old_start,
                data_start + tensors.get(j).data_offsets.0,
            );
            let len = tensors.get(j).nbytes();
            if from % block == to % block {
                let head = ((block - from % block) % block).min(len);
                shared += (len - head) / block * block;
            }
        }
        if shared == 0 {
            return Err("no tensor would keep its place within its blocks".into());
        }
        let end = tensors.last().map_or(0, |t| t.data_offsets.1);
        let end_pad = end.next_multiple_of(new.format.alignment()) - end;
        Ok((
            Layout {
                header,
                tensors,
                source_index: order,
                end_pad,
            },
            Box::new(RewritePlan {
                why: why_not.to_string(),
                sharing: Some((block, shared)),
            }),
        ))
    }
}

/// The order of a new file that keeps the source's bytes in their order:
/// the source's own tensors by their offset in it, then the others by name.
/// With `same_size_names`, a tensor of new bytes under a name the source
/// had, of that tensor's length (a same-size overwrite), takes its place
/// too. Returns the source's own tensors (their offset, their input) and
/// the order.
pub(super) fn source_order(
    new: &NewState,
    same_size_names: bool,
) -> (Vec<(u64, usize)>, Vec<usize>) {
    let old = new.source.header();
    let mut claimed = vec![false; old.tensors.len()];
    let mut kept = Vec::new();
    let mut others = Vec::new();
    for (k, input) in new.inputs.iter().enumerate() {
        // (A partly staged tensor is mostly its source tensor's bytes.)
        match input.source_tensor() {
            Some((src, i)) if Arc::ptr_eq(src, new.source) && !claimed[i as usize] => {
                claimed[i as usize] = true;
                kept.push((old.tensors.get(i as usize).data_offsets.0, k));
            }
            _ => others.push(k),
        }
    }
    kept.sort_unstable();
    let mut placed = kept.clone();
    let mut rest = Vec::new();
    let by_name: std::collections::HashMap<&str, usize> = match same_size_names {
        true => (0..old.tensors.len())
            .map(|i| (old.tensors.name(i), i))
            .collect(),
        false => Default::default(),
    };
    for k in others {
        match by_name.get(new.specs[k].0) {
            Some(&i) if !claimed[i] && old.tensors.nbytes(i) == new.inputs[k].len() => {
                claimed[i] = true;
                placed.push((old.tensors.get(i).data_offsets.0, k));
            }
            _ => rest.push(k),
        }
    }
    placed.sort_unstable();
    rest.sort_by(|&a, &b| new.specs[a].0.cmp(new.specs[b].0));
    let order = placed.into_iter().map(|(_, k)| k).chain(rest).collect();
    (kept, order)
}

/// The tensor table of the new state laid out back to back in `order`
/// (each at an offset its format aligns).
pub(super) fn tensors_in_order(
    new: &NewState,
    order: &[usize],
) -> Result<crate::format::Tensors, Declined> {
    let mut tensors = crate::format::Tensors::with_capacity(order.len());
    let mut offset = 0u64;
    for &k in order {
        let (name, dtype, shape) = new.specs[k];
        let n = new.inputs[k].len();
        offset = offset.next_multiple_of(new.format.alignment());
        tensors
            .push(name, dtype, shape, (offset, offset + n))
            .map_err(|_| "the header is too large".to_string())?;
        offset += n;
    }
    Ok(tensors)
}

/// A new file renamed over the source: the reference's layout, with room
/// left in the header unless `--compact`.
pub(super) struct RewriteWay;

impl CommitWay for RewriteWay {
    fn plan(
        &self,
        new: &NewState,
        why_not: &str,
    ) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
        Ok((
            new.reference.clone(),
            Box::new(RewritePlan {
                why: why_not.to_string(),
                sharing: None,
            }),
        ))
    }
}
