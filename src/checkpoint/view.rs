//! Views (docs/SEMANTICS.md, "Views"): read-only files computed from a checkpoint's staged
//! state on every read, never stored. A view is a whole safetensors file,
//! laid out as `stfs commit --compact` would write it (the reference
//! serializer's layout), optionally with every floating-point tensor cast to
//! one dtype. Its header is made once per staged state; a read at any offset
//! computes only the bytes asked for, from the tensors' bytes (the source,
//! a staging file) and, for a cast, a conversion of just those elements.

use crate::format::{Dtype, FormatError, Metadata, layout_of};
use std::sync::Arc;

use crate::source::{Bytes, SourceFile};

/// One tensor of a view: its name, dtype and shape in the checkpoint, and its bytes.
#[derive(Clone)]
pub struct ViewTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub bytes: Bytes,
}

/// A safetensors file generated from tensors: the header, then each
/// tensor's bytes in file order.
pub struct GeneratedFile {
    header: Vec<u8>,
    /// File order: (start in the file, the tensor, the dtype it is shown as).
    parts: Vec<(u64, ViewTensor, Dtype)>,
    len: u64,
    /// The source file it is byte for byte, if it is one (found once).
    same_as: std::sync::OnceLock<Option<Arc<SourceFile>>>,
}

/// The dtype a tensor of `dtype` is shown as in a view cast to `to`: every
/// floating-point dtype but F8 becomes `to`; the others stay.
pub fn cast_dtype(dtype: Dtype, to: Option<Dtype>) -> Dtype {
    match to {
        Some(to) if matches!(dtype, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16) => to,
        _ => dtype,
    }
}

impl GeneratedFile {
    /// The file `save_file` would write for `tensors` and `metadata`, with
    /// floating-point tensors cast to `cast` if given.
    pub fn safetensors(
        tensors: Vec<ViewTensor>,
        metadata: Option<&Metadata>,
        cast: Option<Dtype>,
    ) -> Result<GeneratedFile, FormatError> {
        let shown: Vec<Dtype> = tensors.iter().map(|t| cast_dtype(t.dtype, cast)).collect();
        let layout = layout_of(
            tensors.len(),
            |i| {
                (
                    tensors[i].name.as_str(),
                    shown[i],
                    tensors[i].shape.as_slice(),
                )
            },
            metadata,
        )?;
        let start = layout.header.len() as u64;
        let mut slots: Vec<Option<ViewTensor>> = tensors.into_iter().map(Some).collect();
        let mut parts = Vec::with_capacity(slots.len());
        for (placed, &k) in layout.tensors.iter().zip(&layout.source_index) {
            let t = slots[k].take().expect("each tensor placed once");
            parts.push((start + placed.data_offsets.0, t, shown[k]));
        }
        Ok(GeneratedFile {
            len: layout.file_len(),
            header: layout.header,
            parts,
            same_as: Default::default(),
        })
    }

    /// `tensor` as a `.npy` file (numpy's format, version 1.0; 2.0 for a
    /// header past 64 KiB): a header that says its dtype and shape, then its
    /// bytes as they are. Dtypes numpy has no name for are shown as the
    /// unsigned integers of their width (BF16 as `<u2`, F8 as `|u1`: view
    /// them as `ml_dtypes` types); packed ones (F4, F6) as their bytes.
    pub fn npy(tensor: ViewTensor) -> GeneratedFile {
        let (descr, shape) = npy_descr(tensor.dtype, &tensor.shape, tensor.bytes.len());
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        let shape = match dims.len() {
            1 => format!("({},)", dims[0]),
            _ => format!("({})", dims.join(", ")),
        };
        let mut dict =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        // As numpy's `_write_array_header`: room for the first axis to grow
        // to 21 digits, then spaces to a multiple of 64 bytes in all (64 more
        // when it is one already), then a newline; version 2.0 (a 4-byte
        // length) only when that passes 65535 bytes.
        if let Some(first) = dims.first() {
            dict.extend(std::iter::repeat_n(
                ' ',
                21usize.saturating_sub(first.len()),
            ));
        }
        let stored = |prefix: usize| {
            let hlen = dict.len() + 1;
            hlen + 64 - (prefix + hlen) % 64
        };
        let (version, prefix) = match stored(10) {
            n if n <= 65535 => (1u8, 10),
            _ => (2, 12),
        };
        let dict_len = stored(prefix);
        let total = prefix + dict_len;
        let mut header = Vec::with_capacity(total);
        header.extend_from_slice(b"\x93NUMPY");
        header.extend_from_slice(&[version, 0]);
        match version {
            1 => header.extend_from_slice(&(dict_len as u16).to_le_bytes()),
            _ => header.extend_from_slice(&(dict_len as u32).to_le_bytes()),
        }
        header.extend_from_slice(dict.as_bytes());
        header.resize(total - 1, b' ');
        header.push(b'\n');
        let start = header.len() as u64;
        let dtype = tensor.dtype;
        GeneratedFile {
            len: start + tensor.bytes.len(),
            header,
            parts: vec![(start, tensor, dtype)],
            same_as: Default::default(),
        }
    }

    /// A file of `header`, then each tensor at its place (file order), the
    /// bytes between them zeros (a GGUF file's padding), `len` bytes in all.
    pub fn placed(header: Vec<u8>, tensors: Vec<(u64, ViewTensor)>, len: u64) -> GeneratedFile {
        GeneratedFile {
            len,
            header,
            parts: tensors
                .into_iter()
                .map(|(start, t)| {
                    let dtype = t.dtype;
                    (start, t, dtype)
                })
                .collect(),
            same_as: Default::default(),
        }
    }

    /// A generated text file (an index) as one: its bytes, no tensors.
    pub fn text(bytes: Vec<u8>) -> GeneratedFile {
        GeneratedFile {
            len: bytes.len() as u64,
            header: bytes,
            parts: Vec::new(),
            same_as: Default::default(),
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// The source file this is, byte for byte, now (a view of an unedited
    /// checkpoint that `save_file` wrote): a reader can be given that file
    /// itself (kernel passthrough). Its header is compared once; that the
    /// file is still as validated, at every call.
    pub fn whole_source(&self) -> Option<&Arc<SourceFile>> {
        let source = self
            .same_as
            .get_or_init(|| self.find_whole_source())
            .as_ref()?;
        source.is_now(&self.header, self.len).then_some(source)
    }

    fn find_whole_source(&self) -> Option<Arc<SourceFile>> {
        let Bytes::Source(source, _) = &self.parts.first()?.1.bytes else {
            return None;
        };
        if source.header().tensors.len() != self.parts.len() {
            return None;
        }
        for (start, t, shown) in &self.parts {
            let Bytes::Source(s, i) = &t.bytes else {
                return None;
            };
            if !Arc::ptr_eq(s, source) || *shown != t.dtype {
                return None;
            }
            if s.tensor_range(*i as usize).start != *start {
                return None;
            }
        }
        source.starts_with(&self.header).then(|| source.clone())
    }

    /// The bytes it reads from (an in-place commit leaves them alone while
    /// a descriptor reads the view).
    pub fn bytes(&self) -> impl Iterator<Item = &Bytes> {
        self.parts.iter().map(|(_, t, _)| &t.bytes)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Serves up to `size` bytes at `offset` to `reply` (fewer at the end):
    /// straight from the source's mapping when they lie in one tensor shown
    /// as it is (most reads of a large file), else through a buffer kept by
    /// the thread (a fresh large buffer per read costs page faults).
    pub fn read<R>(
        &self,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[&[u8]]) -> R,
    ) -> std::io::Result<R> {
        let want = (size as u64).min(self.len.saturating_sub(offset));
        if offset >= self.header.len() as u64 && want > 0 {
            let p = self.parts.partition_point(|(start, ..)| *start <= offset);
            if let Some((start, t, shown)) = p.checked_sub(1).map(|p| &self.parts[p]) {
                let len = crate::format::byte_len(*shown, &t.shape).unwrap_or(0);
                if *shown == t.dtype && offset + want <= start + len {
                    return t.bytes.read(offset - start, want as u32, |b| reply(&[b]));
                }
            }
        }
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < want as usize {
                buf.resize(want as usize, 0);
            }
            let n = self.read_at(&mut buf[..want as usize], offset)?;
            Ok(reply(&[&buf[..n]]))
        })
    }

    /// Fills `buf` with the bytes at `offset` (fewer at the end of the file).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let want = (buf.len() as u64).min(self.len.saturating_sub(offset)) as usize;
        let mut done = 0;
        while done < want {
            let at = offset + done as u64;
            let out = &mut buf[done..want];
            let n = if at < self.header.len() as u64 {
                let h = &self.header[at as usize..];
                let n = h.len().min(out.len());
                out[..n].copy_from_slice(&h[..n]);
                n
            } else {
                // The part holding `at`: the last one starting at or before it;
                // past its bytes (or before the first), zeros up to the next
                // part (padding).
                let p = self.parts.partition_point(|(start, ..)| *start <= at);
                let (start, len) = match p.checked_sub(1).map(|p| &self.parts[p]) {
                    Some((start, t, shown)) => (
                        *start,
                        crate::format::byte_len(*shown, &t.shape).unwrap_or(0),
                    ),
                    None => (at, 0),
                };
                let within = at - start;
                if within >= len {
                    let next = self.parts.get(p).map_or(self.len, |(s, ..)| *s);
                    let n = ((next - at) as usize).min(out.len());
                    out[..n].fill(0);
                    n
                } else {
                    let (_, t, shown) = &self.parts[p - 1];
                    let n = ((len - within) as usize).min(out.len());
                    read_cast(&t.bytes, t.dtype, *shown, within, &mut out[..n])?;
                    n
                }
            };
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    }
}

/// The numpy dtype (`descr`) and shape a tensor is shown as in a `.npy` view.
pub fn npy_descr(dtype: Dtype, shape: &[u64], nbytes: u64) -> (&'static str, Vec<u64>) {
    use Dtype::*;
    let descr = match dtype {
        BOOL => "|b1",
        U8 | F8_E5M2 | F8_E4M3 | F8_E8M0 | F8_E4M3FNUZ | F8_E5M2FNUZ => "|u1",
        I8 => "|i1",
        I16 => "<i2",
        U16 | BF16 => "<u2",
        F16 => "<f2",
        I32 => "<i4",
        U32 => "<u4",
        F32 => "<f4",
        C64 => "<c8",
        F64 => "<f8",
        I64 => "<i8",
        U64 => "<u8",
        // Packed (several elements per byte, or ggml's quantized blocks):
        // no numpy shape fits, so the bytes as they are.
        _ => return ("|u1", vec![nbytes]),
    };
    (descr, shape.to_vec())
}

/// Reads `out.len()` bytes at `offset` of a tensor of `from` shown as `to`.
fn read_cast(
    bytes: &Bytes,
    from: Dtype,
    to: Dtype,
    offset: u64,
    out: &mut [u8],
) -> std::io::Result<()> {
    if from == to {
        return bytes.read_exact_at(offset, out);
    }
    let (a, b) = (from.bits() / 8, to.bits() / 8);
    // The elements that hold the bytes asked for, in chunks.
    const CHUNK: u64 = 1 << 16;
    thread_local! {
        static CHUNKS: std::cell::RefCell<(Vec<u8>, Vec<u8>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    CHUNKS.with(|chunks| {
        let (src, dst) = &mut *chunks.borrow_mut();
        src.resize((CHUNK * 8) as usize, 0);
        dst.resize((CHUNK * 8) as usize, 0);
        cast_chunks(bytes, from, to, (a, b), offset, out, (src, dst), CHUNK)
    })
}

/// `read_cast`, with its buffers.
#[allow(clippy::too_many_arguments)]
fn cast_chunks(
    bytes: &Bytes,
    from: Dtype,
    to: Dtype,
    (a, b): (u64, u64),
    offset: u64,
    out: &mut [u8],
    (src, dst): (&mut [u8], &mut [u8]),
    chunk: u64,
) -> std::io::Result<()> {
    let first = offset / b;
    let last = (offset + out.len() as u64).div_ceil(b);
    let mut e = first;
    while e < last {
        let n = (last - e).min(chunk);
        let src = &mut src[..(n * a) as usize];
        bytes.read_exact_at(e * a, src)?;
        let dst = &mut dst[..(n * b) as usize];
        convert(from, to, src, dst);
        // The part of these elements' bytes that was asked for.
        let lo = (e * b).max(offset);
        let hi = ((e + n) * b).min(offset + out.len() as u64);
        out[(lo - offset) as usize..(hi - offset) as usize]
            .copy_from_slice(&dst[(lo - e * b) as usize..(hi - e * b) as usize]);
        e += n;
    }
    Ok(())
}

/// Converts little-endian elements of `from` in `src` to `to` in `dst`.
fn convert(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) {
    let a = from.bits() as usize / 8;
    let b = to.bits() as usize / 8;
    for (s, d) in src.chunks_exact(a).zip(dst.chunks_exact_mut(b)) {
        // Through f64 where that is exact (from F32, F16, BF16). F64 to F16
        // rounds once, as numpy does, and so does F64 to BF16, as ml_dtypes
        // (0.7 and later) does.
        let wide = match from {
            Dtype::F64 => f64::from_le_bytes(s.try_into().expect("8 bytes")),
            Dtype::F32 => f32::from_le_bytes(s.try_into().expect("4 bytes")) as f64,
            Dtype::F16 => half::f16::from_le_bytes(s.try_into().expect("2 bytes")).to_f64(),
            Dtype::BF16 => bf16_to_f32(u16::from_le_bytes(s.try_into().expect("2 bytes"))) as f64,
            _ => unreachable!("only floating-point tensors are cast"),
        };
        match to {
            Dtype::F64 => d.copy_from_slice(&wide.to_le_bytes()),
            Dtype::F32 => d.copy_from_slice(&(wide as f32).to_le_bytes()),
            Dtype::F16 if from == Dtype::F64 => d.copy_from_slice(&f64_to_f16(wide).to_le_bytes()),
            Dtype::F16 => d.copy_from_slice(&half::f16::from_f32(wide as f32).to_le_bytes()),
            Dtype::BF16 => d.copy_from_slice(&f64_to_bf16(wide).to_le_bytes()),
            _ => unreachable!("casts are to floating-point dtypes"),
        }
    }
}

/// F64 to BF16 bits, rounded once to nearest, ties to even, as ml_dtypes
/// 0.7 and later do. The F64 is first narrowed to F32 rounding to odd (cut
/// toward zero, the last bit set if anything was cut), which keeps enough
/// of it (16 more bits than BF16) for the one rounding to BF16 to be exact;
/// rounding to nearest twice would not be (`1 + 2^-8 + 2^-30` gives 1.0).
pub fn f64_to_bf16(x: f64) -> u16 {
    let f = x as f32;
    if x.is_nan() || f as f64 == x {
        return f32_to_bf16(f); // exact (infinities too)
    }
    let bits = if f.is_infinite() {
        // Past F32's range, cut toward zero: its largest finite value (odd).
        f32::MAX.copysign(f).to_bits()
    } else if (f as f64).abs() > x.abs() {
        f.to_bits() - 1 // rounded away from zero: one step back (the same sign)
    } else {
        f.to_bits()
    };
    f32_to_bf16(f32::from_bits(bits | 1))
}

/// F64 to F16 bits, rounded once to nearest, ties to even, as numpy does
/// (through F32, some halfway cases would round twice); a NaN keeps the top
/// of its payload, as numpy's.
pub fn f64_to_f16(x: f64) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 48) & 0x8000) as u16;
    let exp = ((b >> 52) & 0x7ff) as i64;
    let man = b & 0x000f_ffff_ffff_ffff;
    if exp == 0x7ff {
        if man == 0 {
            return sign | 0x7c00;
        }
        let m = (man >> 42) as u16;
        return sign | 0x7c00 | if m == 0 { 1 } else { m };
    }
    // The significand with its leading bit, and the F16 exponent it has.
    let (sig, mut e) = match exp {
        0 => (man, 1 - 1023 + 15),
        _ => (man | 1 << 52, exp - 1023 + 15),
    };
    if e >= 31 {
        return sign | 0x7c00;
    }
    // Bits of the significand that F16 drops: 42, more below its normal range.
    let shift = if e >= 1 { 42 } else { 42 + (1 - e) } as u32;
    if shift >= 64 {
        return sign;
    }
    let mut m = sig >> shift;
    let rest = sig & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rest > half || (rest == half && m & 1 == 1) {
        m += 1;
    }
    if e < 1 {
        // Subnormal (1024 after rounding is the smallest normal: the same bits).
        return sign | m as u16;
    }
    if m >= 2048 {
        m >>= 1;
        e += 1;
    }
    if e >= 31 {
        return sign | 0x7c00;
    }
    sign | ((e as u16) << 10) | (m as u16 & 0x3ff)
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest, ties to even, as ml_dtypes (Eigen) does; a NaN becomes
/// the quiet NaN of its sign.
pub fn f32_to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    if f.is_nan() {
        return if bits >> 31 == 1 { 0xFFC0 } else { 0x7FC0 };
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_specials() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between 1 and the next bf16: ties to even (1).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1 + 3 * 2^-8: halfway, rounds up to the even 0x3F82.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xFF80);
        assert_eq!(f32_to_bf16(f32::NAN), 0x7FC0);
        assert_eq!(f32_to_bf16(-f32::NAN), 0xFFC0);
        // The largest finite f32 rounds to infinity, as in ml_dtypes.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
    }

    #[test]
    fn f64_to_bf16_rounds_once() {
        let bits = |x: f64| f64_to_bf16(x);
        // Just past halfway between 1 and the next BF16: up, where through F32 it ties to 1.
        assert_eq!(bits(1.0 + 2f64.powi(-8) + 2f64.powi(-30)), 0x3F81);
        assert_eq!(bits(-(1.0 + 2f64.powi(-8) + 2f64.powi(-30))), 0xBF81);
        assert_eq!(bits(1.0 + 2f64.powi(-8)), 0x3F80); // a tie: to even
        assert_eq!(bits(1.0 + 3.0 * 2f64.powi(-8)), 0x3F82); // a tie: to even, up
        // A subnormal past halfway of the smallest one (2^-133): up, not to zero.
        assert_eq!(bits(2f64.powi(-134) + 2f64.powi(-170)), 0x0001);
        assert_eq!(bits(2f64.powi(-134)), 0x0000);
        // Past F32's range: to infinity, as past BF16's; specials kept.
        assert_eq!(bits(1e300), 0x7F80);
        assert_eq!(bits(-1e300), 0xFF80);
        assert_eq!(bits(f64::INFINITY), 0x7F80);
        assert_eq!(bits(-0.0), 0x8000);
        assert_eq!(bits(1e-300), 0x0000);
        assert!(bits(f64::NAN) & 0x7F80 == 0x7F80 && bits(f64::NAN) & 0x7F != 0);
        // Wherever F32 is exact, the same as from F32.
        for x in [1.5f32, -3.25, 65504.0, 1e-40, 3.4e38] {
            assert_eq!(bits(x as f64), f32_to_bf16(x), "{x}");
        }
    }

    #[test]
    fn f64_to_f16_rounds_once() {
        // Halfway between two F16 after rounding to F32 first, not before.
        assert_eq!(f64_to_f16(1.0 + 2f64.powi(-11) + 2f64.powi(-40)), 0x3C01);
        assert_eq!(f64_to_f16(-(1.0 + 2f64.powi(-11) + 2f64.powi(-40))), 0xBC01);
        assert_eq!(f64_to_f16(1.0 + 2f64.powi(-11)), 0x3C00); // a tie: to even
        assert_eq!(f64_to_f16(65504.0), 0x7BFF);
        assert_eq!(f64_to_f16(65520.0), 0x7C00); // rounds up past the largest
        assert_eq!(f64_to_f16(2f64.powi(-24)), 0x0001); // the smallest subnormal
        assert_eq!(f64_to_f16(2f64.powi(-25)), 0x0000); // a tie with 0: to even
        assert_eq!(f64_to_f16(-0.0), 0x8000);
        assert_eq!(f64_to_f16(f64::INFINITY), 0x7C00);
        assert!(f64_to_f16(f64::NAN) & 0x7C00 == 0x7C00 && f64_to_f16(f64::NAN) & 0x3FF != 0);
        // Every F16 value comes back as itself.
        for bits in 0..=0xFFFFu16 {
            let v = half::f16::from_bits(bits);
            if v.is_finite() {
                assert_eq!(f64_to_f16(v.to_f64()), bits, "{bits:#x}");
            }
        }
    }

    #[test]
    fn npy_headers_say_the_shape_as_numpy_does() {
        let dir = tempfile::tempdir().unwrap();
        let staging = crate::source::StagingDir::create(
            Arc::new(crate::source::Folder::open(dir.path()).unwrap()),
            "n",
        )
        .unwrap();
        let staging = Arc::new(staging);
        let header = |shape: Vec<u64>, n: usize| {
            let bytes = Bytes::Staged(staging.file_with(&vec![0u8; n]).unwrap());
            let t = ViewTensor {
                name: "t".into(),
                dtype: Dtype::U8,
                shape,
                bytes,
            };
            let f = GeneratedFile::npy(t);
            let mut out = vec![0u8; f.len() as usize - n];
            f.read_at(&mut out, 0).unwrap();
            assert_eq!(out.len() % 64, 0, "the data starts on 64 bytes");
            String::from_utf8(out[10..].to_vec()).unwrap()
        };
        // As np.save writes them: a one-element tuple has its comma.
        assert!(
            header(vec![5], 5)
                .starts_with("{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }")
        );
        assert!(
            header(vec![2, 3], 6)
                .starts_with("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }")
        );
        assert!(
            header(vec![], 1)
                .starts_with("{'descr': '|u1', 'fortran_order': False, 'shape': (), }")
        );
    }

    #[test]
    fn a_view_reads_the_same_at_any_offset() {
        let dir = tempfile::tempdir().unwrap();
        let staging = Arc::new(
            crate::source::StagingDir::create(
                Arc::new(crate::source::Folder::open(dir.path()).unwrap()),
                "v",
            )
            .unwrap(),
        );
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.37 - 100.0).collect();
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let a = staging.file_with(&data).unwrap();
        let b = staging.file_with(&[1, 2, 3]).unwrap();
        let tensors = || {
            vec![
                ViewTensor {
                    name: "w".into(),
                    dtype: Dtype::F32,
                    shape: vec![1000],
                    bytes: Bytes::Staged(a.clone()),
                },
                ViewTensor {
                    name: "ids".into(),
                    dtype: Dtype::U8,
                    shape: vec![3],
                    bytes: Bytes::Staged(b.clone()),
                },
                ViewTensor {
                    name: "z".into(),
                    dtype: Dtype::U8,
                    shape: vec![3],
                    bytes: Bytes::Staged(b.clone()),
                },
            ]
        };
        for cast in [None, Some(Dtype::BF16), Some(Dtype::F16), Some(Dtype::F64)] {
            let view = GeneratedFile::safetensors(tensors(), None, cast).unwrap();
            let mut whole = vec![0u8; view.len() as usize];
            assert_eq!(view.read_at(&mut whole, 0).unwrap(), whole.len());
            let parsed = crate::format::Header::parse(&whole).unwrap();
            let w = parsed.get("w").unwrap();
            assert_eq!(w.dtype, cast.unwrap_or(Dtype::F32));
            assert_eq!(parsed.get("ids").unwrap().dtype, Dtype::U8);
            // Every read at any offset and size agrees with the whole.
            for (off, len) in [
                (0, 7),
                (3, 100),
                (50, 4000),
                (whole.len() as u64 - 5, 100),
                (101, 1),
            ] {
                let mut part = vec![0u8; len];
                let n = view.read_at(&mut part, off).unwrap();
                assert_eq!(&part[..n], &whole[off as usize..off as usize + n]);
                // And `read`, which serves a range within one tensor shown
                // as it is straight from its bytes.
                let got = view.read(off, len as u32, |p| p.concat()).unwrap();
                assert_eq!(got, &whole[off as usize..off as usize + n]);
            }
            // Across every tensor's start and end, 1 to 7 bytes.
            let edges = parsed.tensors.iter().flat_map(|t| {
                let d = parsed.data_start();
                [d + t.data_offsets.0, d + t.data_offsets.1]
            });
            for edge in edges.collect::<Vec<_>>() {
                for back in 0..4u64 {
                    for len in 1..8u32 {
                        let off = edge.saturating_sub(back);
                        let got = view.read(off, len, |p| p.concat()).unwrap();
                        let end = (off + len as u64).min(whole.len() as u64) as usize;
                        assert_eq!(got, &whole[off as usize..end], "{cast:?} at {off}+{len}");
                    }
                }
            }
            for k in 0..200u64 {
                let off = (k * 7919) % whole.len() as u64;
                let len = 1 + (k % 7) as u32;
                let got = view.read(off, len, |p| p.concat()).unwrap();
                let end = (off + len as u64).min(whole.len() as u64) as usize;
                assert_eq!(got, &whole[off as usize..end], "{cast:?} at {off}");
            }
            if cast == Some(Dtype::BF16) {
                let start = parsed.data_start() + w.data_offsets.0;
                let got = u16::from_le_bytes(
                    whole[start as usize + 2..start as usize + 4]
                        .try_into()
                        .unwrap(),
                );
                assert_eq!(got, f32_to_bf16(values[1]));
            }
        }
    }
}
