//! The ways a commit can take, cheapest first (docs/ARCHITECTURE.md, "The
//! seams"): each plans a new state or says why it cannot.

use super::*;
use crate::checkpoint::Declined;

/// How a plan writes its file: one of the ways (docs/SEMANTICS.md, "The ways").
// One per plan: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Way {
    /// The source's own file, changed where it is, under a write lease
    /// (none in a preview: `stfs status` changes nothing).
    InPlace {
        layout: InPlaceLayout,
        lease: Option<Lease>,
        file: Arc<File>,
        /// The modification time the file gets when done.
        mtime: (i64, i64),
    },
    /// A new file renamed over the source, its tensors in the source's
    /// order and at the same places within their blocks, so that their
    /// blocks are shared with the source's (XFS, btrfs); `shared`: the bytes
    /// it expects to share.
    SharedExtents {
        why: String,
        block: u64,
        shared: u64,
    },
    /// A new file renamed over the source; `why`: why not in place.
    Rewrite { why: String },
    /// A new object at a remote source's key, made of uploaded parts and
    /// server-side copies of the old one (`remote`), conditional on the
    /// ETag mounted (None: `--force`); `record`: where the upload's id is
    /// recorded (set by the plan).
    Remote {
        parts: super::remote::PartPlan,
        if_match: Option<String>,
        record: Option<(Arc<Folder>, String)>,
    },
}

impl Way {
    /// What `stfs status` and `stfs commit` say of it.
    pub fn describe(&self, file_len: u64) -> String {
        match self {
            Way::InPlace { layout, lease, .. } => format!(
                "{}{}",
                in_place_words(&layout.summary, layout.bytes, layout.shareable),
                match lease {
                    Some(_) => "",
                    None => ", unless another program has the file open then",
                }
            ),
            Way::SharedExtents { why, shared, .. } => format!(
                "by a rewrite that shares extents (not in place: {why}; {} written, {} shared with the old file)",
                human_bytes(file_len - shared),
                human_bytes(*shared)
            ),
            Way::Rewrite { why } => format!(
                "by a rewrite (not in place: {why}; {} written)",
                human_bytes(file_len)
            ),
            Way::Remote { parts, .. } => super::remote::describe(parts),
        }
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

/// Pads a rewrite's header so that the data section starts on a 4 KiB
/// boundary with room to spare (a quarter of the JSON, at least 4 KiB): the
/// next header edits are in place. Readers accept trailing spaces.
pub(super) fn leave_room(layout: &mut Layout) {
    const BLOCK: u64 = 4096;
    let json = layout.header.len() as u64 - crate::format::PREFIX_LEN;
    let want = crate::format::PREFIX_LEN + json + (json / 4).max(BLOCK);
    let total = want.div_ceil(BLOCK) * BLOCK;
    let room = (total - crate::format::PREFIX_LEN).min(crate::format::MAX_HEADER_LEN);
    if room <= json {
        return;
    }
    layout
        .header
        .resize((crate::format::PREFIX_LEN + room) as usize, b' ');
    layout.header[..8].copy_from_slice(&room.to_le_bytes());
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
    pub metadata: Option<&'a crate::format::Metadata>,
    /// Bytes that open descriptors and the other shards read.
    pub held: &'a [Bytes],
    /// The file at the source's name is still the one mapped.
    pub unchanged: bool,
    pub options: CommitOptions,
    /// The reference serializer's layout of the new state.
    pub reference: Layout,
    /// A plan only to say what a commit would do (`stfs status`): it takes no
    /// lease and changes nothing.
    pub preview: bool,
}

/// A way of committing a checkpoint (docs/ARCHITECTURE.md, "The seams"): its plan for a new state
/// (the new file's layout, and what landing it takes), or why it cannot.
pub trait CommitWay: Sync {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), Declined>;
}

/// The ways, cheapest first: the planner takes the first that can.
pub(super) const WAYS: [&dyn CommitWay; 3] = [&InPlaceWay, &SharedExtentsWay, &RewriteWay];

/// The plan of the first way that can commit `new`; a rewrite says why the
/// cheaper ways could not. (Only a remote commit can fail to plan: an
/// object S3 cannot hold.)
pub(super) fn choose(new: &NewState) -> Result<(Layout, Way), Declined> {
    // A remote object has one way.
    if new.source.remote_object().is_some() {
        return super::remote::plan(new);
    }
    let mut why_not = Vec::new();
    for way in WAYS {
        match way.plan(new) {
            Ok((layout, Way::Rewrite { .. })) => {
                let why = why_not.join("; ");
                return Ok((layout, Way::Rewrite { why }));
            }
            Ok((layout, Way::SharedExtents { block, shared, .. })) => {
                let why = why_not.join("; ");
                return Ok((layout, Way::SharedExtents { why, block, shared }));
            }
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
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), Declined> {
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
        let mut held = vec![false; source.header().tensors.len()];
        for b in new.held {
            if let Bytes::Source(src, i) = b {
                if Arc::ptr_eq(src, source) {
                    held[*i as usize] = true;
                }
            }
        }
        let specs = new.specs;
        let layout = in_place::layout(
            source,
            specs.len(),
            |i| specs[i],
            new.inputs,
            new.metadata,
            &held,
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
            Way::InPlace {
                layout,
                lease,
                file,
                mtime,
            },
        ))
    }
}

/// A new file whose tensors keep the source's order and their places within
/// their blocks, so that the filesystem shares their blocks (FICLONERANGE):
/// a tensor dropped from the middle costs what the blocks around it cost.
pub(super) struct SharedExtentsWay;

impl CommitWay for SharedExtentsWay {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), Declined> {
        if new.options.compact {
            return Err("--compact".into());
        }
        let source = new.source;
        let file = source.file().ok_or("a remote source")?;
        let block = crate::source::local::shares_extents(file)
            .ok_or("this filesystem cannot share blocks between files (XFS and btrfs can)")?;
        let data_start_now = source.header().data_start() + source.shift();
        let (kept, order) = source_order(new);
        let tensors = tensors_in_order(new, &order)?;
        let mut header =
            crate::format::header_bytes(&tensors, new.metadata).map_err(|e| e.to_string())?;
        // Room, and the data section at the old one's place within a block.
        let json = header.len() as u64 - crate::format::PREFIX_LEN;
        let base = json + (json / 4).max(4096);
        let misfit =
            (data_start_now % block + block - (crate::format::PREFIX_LEN + base) % block) % block;
        let room = base + misfit;
        if room > crate::format::MAX_HEADER_LEN {
            return Err("the header would pass 100,000,000 bytes".into());
        }
        header.resize((crate::format::PREFIX_LEN + room) as usize, b' ');
        header[..8].copy_from_slice(&room.to_le_bytes());
        let data_start = crate::format::PREFIX_LEN + room;
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
        Ok((
            Layout {
                header,
                tensors,
                source_index: order,
            },
            Way::SharedExtents {
                why: String::new(),
                block,
                shared,
            },
        ))
    }
}

/// The order of a new file that keeps the source's bytes in their order:
/// the source's own tensors by their offset in it (with that offset), then
/// the others by name.
pub(super) fn source_order(new: &NewState) -> (Vec<(u64, usize)>, Vec<usize>) {
    let old = new.source.header();
    let mut claimed = vec![false; old.tensors.len()];
    let mut kept = Vec::new();
    let mut rest = Vec::new();
    for (k, input) in new.inputs.iter().enumerate() {
        match input {
            Bytes::Source(src, i) if Arc::ptr_eq(src, new.source) && !claimed[*i as usize] => {
                claimed[*i as usize] = true;
                kept.push((old.tensors.get(*i as usize).data_offsets.0, k));
            }
            _ => rest.push(k),
        }
    }
    kept.sort_unstable();
    rest.sort_by(|&a, &b| new.specs[a].0.cmp(new.specs[b].0));
    let order = kept.iter().map(|&(_, k)| k).chain(rest).collect();
    (kept, order)
}

/// The tensor table of the new state laid out back to back in `order`.
pub(super) fn tensors_in_order(
    new: &NewState,
    order: &[usize],
) -> Result<crate::format::Tensors, Declined> {
    let mut tensors = crate::format::Tensors::with_capacity(order.len());
    let mut offset = 0;
    for &k in order {
        let (name, dtype, shape) = new.specs[k];
        let n = new.inputs[k].len();
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
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), Declined> {
        let mut layout = new.reference.clone();
        if !new.options.compact {
            leave_room(&mut layout);
        }
        Ok((layout, Way::Rewrite { why: String::new() }))
    }
}
