//! The ioctl ABI (C-compatible, mirrored in include/stfs.h). FUSE passes only
//! fixed-size ioctls, so every struct has a fixed size and starts with its own
//! size, which the daemon checks: a caller built against another version gets
//! EINVAL instead of misread fields.

/// `'s'`: the ioctl type byte of stfs.
pub const IOC_TYPE: u32 = b's' as u32;

/// Room for a message in a reply.
pub const MESSAGE_LEN: usize = 4080;

/// STFS_IOC_COMMIT, on any file or directory of a checkpoint (the mount's
/// root commits every checkpoint of a folder mount).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CommitArgs {
    /// In: size_of::<CommitArgs>() (4096).
    pub size: u32,
    /// In: COMMIT_FORCE, COMMIT_DISCARD.
    pub flags: u32,
    /// Out: 0, or the errno of the failure.
    pub result: i32,
    pub reserved: u32,
    /// Out: NUL-terminated text: what was committed, or why not.
    pub message: [u8; MESSAGE_LEN],
}

/// Commit even if the source changed behind the mount.
pub const COMMIT_FORCE: u32 = 1;
/// Drop the staged edits instead of committing them.
pub const COMMIT_DISCARD: u32 = 2;

/// `_IOWR('s', 2, struct stfs_commit)`.
pub const IOC_COMMIT: u32 = iowr(2, std::mem::size_of::<CommitArgs>());

/// Linux's `_IOC(_IOC_READ | _IOC_WRITE, type, nr, size)`.
pub const fn iowr(nr: u32, size: usize) -> u32 {
    const READ_WRITE: u32 = 3;
    (READ_WRITE << 30) | ((size as u32) << 16) | (IOC_TYPE << 8) | nr
}

impl CommitArgs {
    pub fn new(flags: u32) -> CommitArgs {
        CommitArgs {
            size: std::mem::size_of::<CommitArgs>() as u32,
            flags,
            result: 0,
            reserved: 0,
            message: [0; MESSAGE_LEN],
        }
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<CommitArgs> {
        if bytes.len() != std::mem::size_of::<CommitArgs>() {
            return None;
        }
        // SAFETY: CommitArgs is repr(C), every bit pattern is valid, and the length matches.
        let args: CommitArgs = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        (args.size as usize == std::mem::size_of::<CommitArgs>()).then_some(args)
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: repr(C) plain data without padding (4 x u32 + u8 array).
        unsafe {
            std::slice::from_raw_parts(
                (self as *const CommitArgs).cast(),
                std::mem::size_of::<CommitArgs>(),
            )
        }
    }

    pub fn set_message(&mut self, text: &str) {
        let n = text.len().min(MESSAGE_LEN - 1);
        self.message[..n].copy_from_slice(&text.as_bytes()[..n]);
        self.message[n] = 0;
    }

    pub fn message(&self) -> String {
        let end = self
            .message
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(MESSAGE_LEN);
        String::from_utf8_lossy(&self.message[..end]).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_sizes_and_numbers() {
        assert_eq!(std::mem::size_of::<CommitArgs>(), 4096);
        // _IOWR('s', 2, 4096 bytes) as the C macro computes it.
        assert_eq!(IOC_COMMIT, 0xd000_7302);
        let mut a = CommitArgs::new(COMMIT_FORCE);
        a.set_message("hello");
        let b = CommitArgs::from_bytes(a.as_bytes()).unwrap();
        assert_eq!((b.flags, b.message()), (COMMIT_FORCE, "hello".to_string()));
        let mut bad = a;
        bad.size = 12;
        assert!(CommitArgs::from_bytes(bad.as_bytes()).is_none());
        assert!(CommitArgs::from_bytes(&[0; 10]).is_none());
    }
}

/// STFS_IOC_PREFETCH, on a tensor file.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PrefetchArgs {
    /// In: size_of::<PrefetchArgs>() (512).
    pub size: u32,
    /// In: TARGET_PAGE_CACHE or TARGET_CUDA.
    pub target: u32,
    /// In: the CUDA device ordinal (TARGET_CUDA).
    pub device: i32,
    /// Out: 0, or the errno of the failure (ENODEV: no CUDA driver or device).
    pub result: i32,
    /// Out: bytes now resident in the page cache, or copied to the device.
    pub bytes: u64,
    /// Out: the tensor's byte length.
    pub nbytes: u64,
    /// Out: time the daemon spent.
    pub elapsed_ns: u64,
    /// Out (TARGET_CUDA): offset of the tensor in the exported allocation.
    pub ipc_offset: u64,
    /// Out (TARGET_CUDA): size of the exported allocation.
    pub alloc_size: u64,
    /// Out (TARGET_CUDA): the CUipcMemHandle of the allocation. It stays valid
    /// until the file descriptor the ioctl was made on is closed.
    pub ipc_handle: [u8; 64],
    /// Out: the dtype, NUL-terminated ("" while the tensor has none).
    pub dtype: [u8; 16],
    /// Out: number of dimensions (at most 16 are reported).
    pub ndim: u32,
    pub reserved: u32,
    /// Out: the shape.
    pub shape: [u64; 16],
    /// Out: NUL-terminated text: what was done, or why not.
    pub message: [u8; PREFETCH_MESSAGE_LEN],
}

pub const PREFETCH_MESSAGE_LEN: usize = 240;
pub const TARGET_PAGE_CACHE: u32 = 0;
pub const TARGET_CUDA: u32 = 1;

/// `_IOWR('s', 1, struct stfs_prefetch)`.
pub const IOC_PREFETCH: u32 = iowr(1, std::mem::size_of::<PrefetchArgs>());

impl PrefetchArgs {
    pub fn new(target: u32, device: i32) -> PrefetchArgs {
        // SAFETY: all-zero is a valid PrefetchArgs (plain integers and arrays).
        let mut a: PrefetchArgs = unsafe { std::mem::zeroed() };
        a.size = std::mem::size_of::<PrefetchArgs>() as u32;
        a.target = target;
        a.device = device;
        a
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<PrefetchArgs> {
        if bytes.len() != std::mem::size_of::<PrefetchArgs>() {
            return None;
        }
        // SAFETY: repr(C) plain data; every bit pattern is valid; length checked.
        let a: PrefetchArgs = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        (a.size as usize == std::mem::size_of::<PrefetchArgs>()).then_some(a)
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: repr(C) plain data without padding (checked by the layout test).
        unsafe {
            std::slice::from_raw_parts(
                (self as *const PrefetchArgs).cast(),
                std::mem::size_of::<PrefetchArgs>(),
            )
        }
    }

    pub fn set_message(&mut self, text: &str) {
        let n = text.len().min(PREFETCH_MESSAGE_LEN - 1);
        self.message[..n].copy_from_slice(&text.as_bytes()[..n]);
        self.message[n] = 0;
    }

    pub fn message(&self) -> String {
        let end = self
            .message
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(PREFETCH_MESSAGE_LEN);
        String::from_utf8_lossy(&self.message[..end]).into_owned()
    }

    pub fn set_dtype(&mut self, dtype: &str) {
        let n = dtype.len().min(15);
        self.dtype[..n].copy_from_slice(&dtype.as_bytes()[..n]);
    }
}

#[cfg(test)]
mod prefetch_tests {
    use super::*;

    #[test]
    fn prefetch_abi_layout() {
        assert_eq!(std::mem::size_of::<PrefetchArgs>(), 512);
        assert_eq!(std::mem::align_of::<PrefetchArgs>(), 8);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, bytes), 16);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, ipc_handle), 56);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, dtype), 120);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, shape), 144);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, message), 272);
        // _IOWR('s', 1, 512 bytes), as the C macro computes it.
        assert_eq!(IOC_PREFETCH, 0xc200_7301);
        let mut a = PrefetchArgs::new(TARGET_CUDA, 3);
        a.set_message("m");
        let b = PrefetchArgs::from_bytes(a.as_bytes()).unwrap();
        assert_eq!(
            (b.target, b.device, b.message()),
            (TARGET_CUDA, 3, "m".to_string())
        );
    }
}
