//! The write half of the format seam: what a commit asks of a checkpoint's
//! format. A format says how a new file is laid out (as its reference
//! writer lays it out, or with room for later header edits), and what
//! header a file changed in place gets, which must end exactly where the
//! data starts now. Everything else of a commit (the ways, the redo record,
//! the landing, recovery) is the same code for every format.

use super::gguf::write::{HeaderOut, ROOM_OVERHEAD, Room};
use super::{Dtype, FormatError, Layout, Metadata, PREFIX_LEN, Tensors, header_bytes, layout_of};

/// Why a header cannot be written where the data starts now.
#[derive(Debug)]
pub enum NoFit {
    /// It needs at least this many bytes before the data.
    Needs(u64),
    Refused(FormatError),
}

/// A tensor of a new state: its name, dtype and shape.
pub type Spec<'a> = (&'a str, Dtype, &'a [u64]);

pub trait FormatWriter: Sync {
    /// Tensor offsets in the data section are multiples of this (and an
    /// in-place commit keeps the data start a multiple of it).
    fn alignment(&self) -> u64;
    /// A new file holding tensors `spec(k)`: laid out as the format's
    /// reference writer lays it out (`compact`), or with room in its header
    /// for later edits in place.
    fn layout<'a>(
        &self,
        count: usize,
        spec: &dyn Fn(usize) -> Spec<'a>,
        compact: bool,
    ) -> Result<Layout, FormatError>;
    /// The header of `tensors` (file order, offsets from the data start)
    /// that ends exactly at `data_start`, and where its content ends (what
    /// follows is padding, there already when the old content ended too).
    fn header_at(&self, tensors: &Tensors, data_start: u64) -> Result<(Vec<u8>, u64), NoFit>;
    /// Whether the commit may keep tensors in place where others were
    /// dropped before them by moving tensors from the end (safetensors: its
    /// data is one run; GGUF: not done, its tensors are padded).
    fn fills_holes(&self) -> bool {
        true
    }
}

/// Safetensors: the reference's layout (dtype descending, then name), its
/// JSON padded with spaces.
pub struct Safetensors<'m> {
    pub metadata: Option<&'m Metadata>,
}

impl FormatWriter for Safetensors<'_> {
    fn alignment(&self) -> u64 {
        1
    }

    fn layout<'a>(
        &self,
        count: usize,
        spec: &dyn Fn(usize) -> Spec<'a>,
        compact: bool,
    ) -> Result<Layout, FormatError> {
        let mut layout = layout_of(count, spec, self.metadata)?;
        if !compact {
            leave_room(&mut layout);
        }
        Ok(layout)
    }

    fn header_at(&self, tensors: &Tensors, data_start: u64) -> Result<(Vec<u8>, u64), NoFit> {
        let mut header = header_bytes(tensors, self.metadata).map_err(NoFit::Refused)?;
        let content_end = header.len() as u64;
        if content_end > data_start {
            return Err(NoFit::Needs(content_end));
        }
        let room = data_start - PREFIX_LEN;
        header.resize(data_start as usize, b' ');
        header[..PREFIX_LEN as usize].copy_from_slice(&room.to_le_bytes());
        Ok((header, content_end))
    }
}

/// Pads a new file's header so that the data section starts on a 4 KiB
/// boundary with room to spare (a quarter of the JSON, at least 4 KiB): the
/// next header edits are in place. Readers accept trailing spaces.
pub fn leave_room(layout: &mut Layout) {
    const BLOCK: u64 = 4096;
    let json = layout.header.len() as u64 - PREFIX_LEN;
    let want = PREFIX_LEN + json + (json / 4).max(BLOCK);
    let total = want.div_ceil(BLOCK) * BLOCK;
    let room = (total - PREFIX_LEN).min(super::MAX_HEADER_LEN);
    if room <= json {
        return;
    }
    layout.header.resize((PREFIX_LEN + room) as usize, b' ');
    layout.header[..8].copy_from_slice(&room.to_le_bytes());
}

/// GGUF: the keys in order (encoded), the tensors in the order given, each
/// padded to the alignment; room in the `stfs.room` key.
pub struct Gguf {
    pub version: u32,
    pub kvs: Vec<(String, Vec<u8>)>,
    pub alignment: u64,
}

impl Gguf {
    fn out(&self, compact: bool) -> HeaderOut<'_> {
        HeaderOut {
            version: match compact {
                true => super::gguf::write::WRITER_VERSION,
                false => self.version,
            },
            kvs: &self.kvs,
            alignment: self.alignment,
        }
    }
}

impl FormatWriter for Gguf {
    fn alignment(&self) -> u64 {
        self.alignment
    }

    fn layout<'a>(
        &self,
        count: usize,
        spec: &dyn Fn(usize) -> Spec<'a>,
        compact: bool,
    ) -> Result<Layout, FormatError> {
        let mut layout = super::gguf::write::layout(&self.out(compact), count, spec)?;
        if !compact {
            // Room as for safetensors (a quarter of the header again, at
            // least 4 KiB), and the data on a 4 KiB boundary.
            let bare = layout.header.len() as u64;
            let block = self.alignment.max(4096);
            let want = (bare + ROOM_OVERHEAD + (bare / 4).max(4096)).div_ceil(block) * block;
            layout.header = self
                .out(false)
                .header(&layout.tensors, Room::Exactly(want))
                .map_err(|_| FormatError::HeaderTooLarge { header_len: want })?;
        }
        Ok(layout)
    }

    fn header_at(&self, tensors: &Tensors, data_start: u64) -> Result<(Vec<u8>, u64), NoFit> {
        let header = self
            .out(false)
            .header(tensors, Room::Exactly(data_start))
            .map_err(NoFit::Needs)?;
        let end = header.len() as u64;
        Ok((header, end))
    }

    fn fills_holes(&self) -> bool {
        false
    }
}
