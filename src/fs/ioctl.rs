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
