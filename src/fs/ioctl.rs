//! The ioctl ABI (C-compatible, mirrored in include/stfs.h). FUSE passes only
//! fixed-size ioctls, so every struct has a fixed size and starts with its own
//! size, which the daemon checks: a caller built against another version gets
//! EINVAL instead of misread fields.

use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

/// `'s'`: the ioctl type byte of stfs.
pub const IOC_TYPE: u32 = b's' as u32;

/// Room for a message in a reply.
pub const MESSAGE_LEN: usize = 4080;

/// STFS_IOC_COMMIT, on any file or directory of a checkpoint (the mount's
/// root commits every checkpoint of a folder mount).
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CommitArgs {
    /// In: size_of::<CommitArgs>() (4096).
    pub size: u32,
    /// In: COMMIT_FORCE, COMMIT_DISCARD, COMMIT_COMPACT.
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
/// Rewrite as the reference's save_file lays a file out (never in place,
/// no room left in the header).
pub const COMMIT_COMPACT: u32 = 4;

/// `_IOWR('s', 2, struct stfs_commit)`.
pub const IOC_COMMIT: u32 = iowr(2, std::mem::size_of::<CommitArgs>());

/// Room for a page of `stfs status` text.
pub const STATUS_TEXT_LEN: usize = 16344;

/// STFS_IOC_STATUS, on any file or directory of the mount: a page of the
/// status report (what is staged, and what a commit would refuse).
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct StatusArgs {
    /// In: size_of::<StatusArgs>() (16376).
    pub size: u32,
    /// In: STATUS_JSON, or 0 for text.
    pub flags: u32,
    /// In: byte offset in the report of the page asked for.
    pub offset: u64,
    /// Out: the report's length.
    pub total: u64,
    /// Out: 0, or an errno.
    pub result: i32,
    /// Out: 1 when a commit would be refused.
    pub refused: u32,
    /// Out: the page, NUL-terminated.
    pub text: [u8; STATUS_TEXT_LEN],
}

/// In StatusArgs' flags: the report as JSON (`stfs status --json`).
pub const STATUS_JSON: u32 = 1;

/// `_IOWR('s', 3, struct stfs_status)`.
pub const IOC_STATUS: u32 = iowr(3, std::mem::size_of::<StatusArgs>());

impl StatusArgs {
    pub fn new(offset: u64, flags: u32) -> Box<StatusArgs> {
        let mut a = Box::new(StatusArgs::new_zeroed());
        a.size = std::mem::size_of::<StatusArgs>() as u32;
        a.offset = offset;
        a.flags = flags;
        a
    }

    /// Fills the page of `report` that starts at `offset` (cut on a char boundary).
    pub fn set_page(&mut self, report: &str) {
        self.total = report.len() as u64;
        let mut start = (self.offset as usize).min(report.len());
        while !report.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (start + STATUS_TEXT_LEN - 1).min(report.len());
        while !report.is_char_boundary(end) {
            end -= 1;
        }
        write_text(&mut self.text, &report[start..end]);
    }

    pub fn page(&self) -> String {
        read_text(&self.text)
    }
}

/// STFS_IOC_PROGRESS, on any file or directory of a mount: how far the
/// commit being written has got (answered at once, while the commit runs).
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ProgressArgs {
    /// In: size_of::<ProgressArgs>() (4096).
    pub size: u32,
    /// Out: 1 while a commit writes a new file, else 0.
    pub active: u32,
    /// Out: bytes of tensor data written so far, of `total`.
    pub done: u64,
    pub total: u64,
    /// Out: the file being written (its final path), NUL-terminated.
    pub file: [u8; PROGRESS_FILE_LEN],
}

pub const PROGRESS_FILE_LEN: usize = 4072;

/// `_IOWR('s', 4, struct stfs_progress)`.
pub const IOC_PROGRESS: u32 = iowr(4, std::mem::size_of::<ProgressArgs>());

impl Default for ProgressArgs {
    fn default() -> ProgressArgs {
        let mut a = ProgressArgs::new_zeroed();
        a.size = std::mem::size_of::<ProgressArgs>() as u32;
        a
    }
}

impl ProgressArgs {
    pub fn set_file(&mut self, path: &std::path::Path) {
        write_text(&mut self.file, &path.display().to_string());
    }

    pub fn file(&self) -> String {
        read_text(&self.file)
    }
}

/// Linux's `_IOC(_IOC_READ | _IOC_WRITE, type, nr, size)`.
pub const fn iowr(nr: u32, size: usize) -> u32 {
    const READ_WRITE: u32 = 3;
    (READ_WRITE << 30) | ((size as u32) << 16) | (IOC_TYPE << 8) | nr
}

/// A fixed-size ioctl struct: plain `repr(C)` data without padding (the
/// zerocopy derives prove it at compile time), whose first field is its own
/// size.
pub trait IoctlStruct: FromBytes + IntoBytes + Immutable + KnownLayout + Copy {
    /// The struct from the bytes the caller passed, if their size and the
    /// struct's own size field both match.
    fn from_caller(bytes: &[u8]) -> Option<Self> {
        let value = Self::read_from_bytes(bytes).ok()?;
        let size = u32::from_ne_bytes(bytes[..4].try_into().expect("4 bytes"));
        (size as usize == std::mem::size_of::<Self>()).then_some(value)
    }
}

impl IoctlStruct for CommitArgs {}
impl IoctlStruct for StatusArgs {}
impl IoctlStruct for PrefetchArgs {}
impl IoctlStruct for ProgressArgs {}

/// Writes NUL-terminated text into a fixed buffer, cut to fit.
fn write_text(buf: &mut [u8], text: &str) {
    let n = text.len().min(buf.len() - 1);
    buf[..n].copy_from_slice(&text.as_bytes()[..n]);
    buf[n] = 0;
}

fn read_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
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

    pub fn set_message(&mut self, text: &str) {
        write_text(&mut self.message, text);
    }

    pub fn message(&self) -> String {
        read_text(&self.message)
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
        let b = CommitArgs::from_caller(a.as_bytes()).unwrap();
        assert_eq!((b.flags, b.message()), (COMMIT_FORCE, "hello".to_string()));
        let mut bad = a;
        bad.size = 12;
        assert!(CommitArgs::from_caller(bad.as_bytes()).is_none());
        assert!(CommitArgs::from_caller(&[0; 10]).is_none());
        assert_eq!(std::mem::size_of::<StatusArgs>(), 16376);
        assert_eq!(IOC_STATUS, 0xfff8_7303);
        let mut st = StatusArgs::new(3, 0);
        st.set_page("héllo");
        assert_eq!((st.total, st.page()), (6, "llo".to_string()));
        // An offset inside a character starts at that character.
        let mut st = StatusArgs::new(2, 0);
        st.set_page("héllo");
        assert_eq!(st.page(), "éllo");
        assert_eq!(std::mem::size_of::<ProgressArgs>(), 4096);
        assert_eq!(IOC_PROGRESS, 0xd000_7304);
    }
}

/// STFS_IOC_PREFETCH, on a tensor file.
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PrefetchArgs {
    /// In: size_of::<PrefetchArgs>() (520).
    pub size: u32,
    /// In: TARGET_PAGE_CACHE or TARGET_CUDA.
    pub target: u32,
    /// In: the CUDA device ordinal (TARGET_CUDA).
    pub device: i32,
    /// Out: 0, or the errno of the failure (ENODEV: no CUDA driver or device;
    /// EINTR: stopped early, see `next`).
    pub result: i32,
    /// Out: bytes of the range now resident in the page cache, or copied to the device.
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
    pub flags: u32,
    /// Out: the shape.
    pub shape: [u64; 16],
    /// In (TARGET_PAGE_CACHE): the byte range of the tensor to bring in
    /// (`length` 0: to the end).
    pub offset: u64,
    pub length: u64,
    /// Out: where the daemon stopped; a request runs for at most a few
    /// seconds, so the caller asks again from here until `next == nbytes`.
    pub next: u64,
    /// Out: NUL-terminated text: what was done, or why not.
    pub message: [u8; PREFETCH_MESSAGE_LEN],
}

pub const PREFETCH_MESSAGE_LEN: usize = 224;
pub const TARGET_PAGE_CACHE: u32 = 0;
pub const TARGET_CUDA: u32 = 1;

/// `_IOWR('s', 1, struct stfs_prefetch)`.
pub const IOC_PREFETCH: u32 = iowr(1, std::mem::size_of::<PrefetchArgs>());

impl PrefetchArgs {
    pub fn new(target: u32, device: i32) -> PrefetchArgs {
        let mut a = PrefetchArgs::new_zeroed();
        a.size = std::mem::size_of::<PrefetchArgs>() as u32;
        a.target = target;
        a.device = device;
        a
    }

    pub fn set_message(&mut self, text: &str) {
        write_text(&mut self.message, text);
    }

    pub fn message(&self) -> String {
        read_text(&self.message)
    }

    pub fn set_dtype(&mut self, dtype: &str) {
        write_text(&mut self.dtype, dtype);
    }
}

#[cfg(test)]
mod prefetch_tests {
    use super::*;

    #[test]
    fn prefetch_abi_layout() {
        assert_eq!(std::mem::size_of::<PrefetchArgs>(), 520);
        assert_eq!(std::mem::align_of::<PrefetchArgs>(), 8);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, bytes), 16);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, ipc_handle), 56);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, dtype), 120);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, shape), 144);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, offset), 272);
        assert_eq!(std::mem::offset_of!(PrefetchArgs, message), 296);
        // _IOWR('s', 1, 520 bytes), as the C macro computes it.
        assert_eq!(IOC_PREFETCH, 0xc208_7301);
        let mut a = PrefetchArgs::new(TARGET_CUDA, 3);
        a.set_message("m");
        let b = PrefetchArgs::from_caller(a.as_bytes()).unwrap();
        assert_eq!(
            (b.target, b.device, b.message()),
            (TARGET_CUDA, 3, "m".to_string())
        );
    }
}

/// STFS_IOC_DAEMON, on any file or directory of a mount: the pid of the
/// daemon that serves it (`stfs umount` waits for it to exit). Anyone may ask.
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DaemonArgs {
    /// In: size_of::<DaemonArgs>() (64).
    pub size: u32,
    /// Out.
    pub pid: u32,
    pub reserved: [u64; 7],
}

impl IoctlStruct for DaemonArgs {}

/// `_IOWR('s', 6, struct stfs_daemon)`.
pub const IOC_DAEMON: u32 = iowr(6, std::mem::size_of::<DaemonArgs>());

impl DaemonArgs {
    pub fn new() -> DaemonArgs {
        let mut a = DaemonArgs::new_zeroed();
        a.size = std::mem::size_of::<DaemonArgs>() as u32;
        a
    }
}

impl Default for DaemonArgs {
    fn default() -> Self {
        DaemonArgs::new()
    }
}

/// Room for names, a glob, a page of the table, or a message.
pub const LOAD_TEXT_LEN: usize = 16184;

/// STFS_IOC_LOAD, on any file or directory of a mount: many tensors into
/// one arena on a device (see include/stfs.h for the protocol).
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct LoadArgs {
    /// In: size_of::<LoadArgs>() (16376).
    pub size: u32,
    /// In: LOAD_*.
    pub op: u32,
    /// In (POLL, TABLE, FREE), out (START): the load.
    pub id: u64,
    /// In (START): TARGET_CUDA or TARGET_HOST, and the CUDA device.
    pub target: u32,
    pub device: i32,
    pub flags: u32,
    /// In (POLL): how long to wait for more to land, at most 1000 ms.
    pub wait_ms: u32,
    /// Out: 0, or an errno (then `text` says why).
    pub result: i32,
    /// Out: 1 once the load has ended (landed, failed or cancelled).
    pub done: u32,
    /// Out: the tensors and bytes planned; of them landed (the first
    /// `landed_tensors` of the table are in place).
    pub tensors: u64,
    pub bytes: u64,
    pub landed_tensors: u64,
    pub landed_bytes: u64,
    /// Out: the arena's size, and the time from the start (to the end once done).
    pub arena_size: u64,
    pub elapsed_ns: u64,
    /// Out: slabs the daemon has made and freed since it started (a pool's
    /// are freed after its idle time), and arenas alive now.
    pub slabs_made: u64,
    pub slabs_freed: u64,
    pub live_arenas: u64,
    /// In (TABLE): byte offset of the page; out: the table's length.
    pub offset: u64,
    pub total: u64,
    /// Out (START, POLL): what a client opens to reach the arena.
    pub handle: [u8; 64],
    /// In: names (NUL-separated) or a glob; out: a page of the table, or why it failed.
    pub text: [u8; LOAD_TEXT_LEN],
}

impl IoctlStruct for LoadArgs {}

pub const TARGET_HOST: u32 = 2;
pub const LOAD_NAMES: u32 = 1;
pub const LOAD_GLOB: u32 = 2;
pub const LOAD_START: u32 = 3;
pub const LOAD_POLL: u32 = 4;
pub const LOAD_TABLE: u32 = 5;
pub const LOAD_FREE: u32 = 6;
/// Flag of a start: read every chunk into a slab and copy it from there,
/// even where the arena is host memory the daemon could read into.
pub const LOAD_THROUGH_SLABS: u32 = 1;

/// `_IOWR('s', 5, struct stfs_load)`.
pub const IOC_LOAD: u32 = iowr(5, std::mem::size_of::<LoadArgs>());

impl LoadArgs {
    pub fn new(op: u32) -> Box<LoadArgs> {
        let mut a = Box::new(LoadArgs::new_zeroed());
        a.size = std::mem::size_of::<LoadArgs>() as u32;
        a.op = op;
        a
    }

    /// The text sent in, up to its first NUL (names keep their NULs: see `names`).
    pub fn text(&self) -> String {
        read_text(&self.text)
    }

    /// The NUL-separated names sent in (an empty name ends them).
    pub fn names(&self) -> impl Iterator<Item = Result<String, std::string::FromUtf8Error>> + '_ {
        self.text
            .split(|&b| b == 0)
            .take_while(|n| !n.is_empty())
            .map(|n| String::from_utf8(n.to_vec()))
    }

    pub fn set_text(&mut self, text: &str) {
        write_text(&mut self.text, text);
    }

    /// The page of `table` from `offset`: raw bytes (a character may be
    /// cut between pages; the caller joins the bytes).
    pub fn set_page(&mut self, table: &[u8]) {
        self.total = table.len() as u64;
        let start = (self.offset as usize).min(table.len());
        let end = (start + LOAD_TEXT_LEN - 1).min(table.len());
        self.text = [0; LOAD_TEXT_LEN];
        self.text[..end - start].copy_from_slice(&table[start..end]);
    }
}

#[cfg(test)]
mod load_tests {
    use super::*;

    #[test]
    fn load_abi_layout() {
        assert_eq!(std::mem::size_of::<LoadArgs>(), 16376);
        assert_eq!(std::mem::offset_of!(LoadArgs, result), 32);
        assert_eq!(std::mem::offset_of!(LoadArgs, tensors), 40);
        assert_eq!(std::mem::offset_of!(LoadArgs, handle), 128);
        assert_eq!(std::mem::offset_of!(LoadArgs, text), 192);
        assert_eq!(IOC_LOAD, 0xfff8_7305);
        assert_eq!(
            (std::mem::size_of::<DaemonArgs>(), IOC_DAEMON),
            (64, 0xc040_7306)
        );
        let mut a = LoadArgs::new(LOAD_NAMES);
        a.text[..6].copy_from_slice(b"a\0b.c\0");
        let names: Vec<_> = a.names().map(Result::unwrap).collect();
        assert_eq!(names, ["a", "b.c"]);
        a.offset = 3;
        a.set_page(b"0123456");
        assert_eq!((a.total, a.text()), (7, "3456".to_string()));
        assert!(LoadArgs::from_caller(&a.as_bytes()[..100]).is_none());
    }
}
