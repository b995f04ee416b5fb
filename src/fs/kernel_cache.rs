//! What the kernel may cache of the names and attributes the mount shows,
//! and the notifications that take it back when the state changes.
//!
//! A listing (`ls -l`, `find`, a loader globbing the folder) asks for every
//! name's attributes. Answered one lookup at a time, 100,000 tensors were
//! 200,000 round trips through FUSE, twice (a path-based `getxattr` walks the
//! path again). With name caching on, a listing is READDIRPLUS (names and
//! attributes in one reply) and the kernel keeps both for `NAME_TTL`.
//!
//! An edit of one name changes others (a tensor's `.meta.json` comes and goes
//! with its data file, a rename moves both, a discard or commit changes
//! many), and those changes must be seen by the next `stat` of any process.
//! Invalidating each name would need the directory's lock, which the kernel
//! holds while it waits for the answer to the unlink or rename that made the
//! change. So every edit of names bumps the connection's epoch
//! (FUSE_NOTIFY_INC_EPOCH, Linux 6.16, FUSE 7.44) before it is answered: no
//! lock, and every name the kernel holds is looked up again on its next use.
//! Attributes of files that an edit of another name changed (a meta's text,
//! a data file a meta sizes, a file replaced) are taken back one inode at a
//! time (FUSE_NOTIFY_INVAL_INODE, attributes only), also before the answer.
//! Kernels without the epoch get no name caching (names looked up each time,
//! as before).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use tracing::{info, warn};

use super::Ino;

/// How long the kernel may keep a name and, from a listing, its attributes
/// (one timeout for both in a listing: as long as attributes are kept
/// elsewhere, so that a `chmod` of the source shows within a second).
/// Changes are taken back by notifications; this bounds what one missed.
pub const NAME_TTL: Duration = Duration::from_secs(1);

/// A listing the daemon answered before an edit, but that the kernel takes
/// in after the edit's epoch bump, would be kept as fresh: every bump is
/// made again this much later (a listing is taken in as soon as it is
/// written, long before).
const BUMP_AGAIN: Duration = Duration::from_millis(100);

/// The FUSE minor version that has FUSE_NOTIFY_INC_EPOCH.
const EPOCH_MINOR: u32 = 44;

const NOTIFY_INVAL_INODE: i32 = 2;
const NOTIFY_INC_EPOCH: i32 = 8;

/// The notifications this mount sends to its kernel connection.
#[derive(Default)]
pub struct KernelCache {
    /// A descriptor of the mount's /dev/fuse connection (none in tests
    /// without a kernel).
    channel: Option<Arc<OwnedFd>>,
    /// Names are cached: the kernel can take them back (set at INIT).
    on: Arc<AtomicBool>,
    /// Wakes the thread that bumps the epoch again (`BUMP_AGAIN`).
    again: Option<mpsc::Sender<()>>,
}

impl KernelCache {
    pub fn new(channel: OwnedFd) -> KernelCache {
        let channel = Arc::new(channel);
        let on = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<()>();
        let (fd, enabled) = (channel.clone(), on.clone());
        let _ = std::thread::Builder::new()
            .name("stfs-epoch".into())
            .spawn(move || {
                // Ends when the cache (its sender) is dropped.
                while rx.recv().is_ok() {
                    std::thread::sleep(BUMP_AGAIN);
                    while rx.try_recv().is_ok() {} // one bump for all since
                    if enabled.load(Ordering::SeqCst) && write(&fd, NOTIFY_INC_EPOCH, &[]).is_err()
                    {
                        enabled.store(false, Ordering::SeqCst);
                    }
                }
            });
        KernelCache {
            channel: Some(channel),
            on,
            again: Some(tx),
        }
    }

    /// At INIT: names are cached if the kernel's FUSE has the epoch.
    pub fn start(&self, kernel_minor: u32) -> bool {
        let on = self.channel.is_some() && kernel_minor >= EPOCH_MINOR;
        if !on {
            info!(
                kernel_minor,
                "the kernel cannot take back every name at once (FUSE 7.{EPOCH_MINOR}, Linux \
                 6.16): names are looked up on each use"
            );
        }
        self.on.store(on, Ordering::SeqCst);
        on
    }

    /// Whether the kernel may keep names (and listings give attributes).
    pub fn names_cached(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// Names changed: every name the kernel keeps is looked up again on its
    /// next use. Call before answering the request that changed them.
    pub fn names_changed(&self) {
        if !self.names_cached() {
            return;
        }
        if self.send(NOTIFY_INC_EPOCH, &[]).is_err() {
            // Not taken back: names stay uncached from now on, and what was
            // cached goes stale for at most NAME_TTL.
            self.on.store(false, Ordering::SeqCst);
            return;
        }
        if let Some(again) = &self.again {
            let _ = again.send(());
        }
    }

    /// Nothing is kept from now on (the mount is going away).
    pub fn stop(&self) {
        self.on.store(false, Ordering::SeqCst);
    }

    /// The attributes of `ino` changed (not its cached pages: no edit of
    /// another name changes the bytes under a file's pages).
    pub fn attrs_changed(&self, ino: Ino) {
        if !self.names_cached() {
            return;
        }
        let mut body = Vec::with_capacity(24);
        body.extend_from_slice(&ino.to_ne_bytes());
        // A negative offset: the attributes only. (Invalidating pages would
        // wait for their locks, which a write in flight holds until the
        // daemon answers it: a request thread must not wait for that.)
        body.extend_from_slice(&(-1i64).to_ne_bytes());
        body.extend_from_slice(&0i64.to_ne_bytes());
        let _ = self.send(NOTIFY_INVAL_INODE, &body);
    }

    fn send(&self, code: i32, body: &[u8]) -> std::io::Result<()> {
        match &self.channel {
            Some(fd) => write(fd, code, body),
            None => Ok(()),
        }
    }
}

/// One notification: a fuse_out_header whose error field is the code, then
/// its body, in one write.
fn write(fd: &OwnedFd, code: i32, body: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&code.to_ne_bytes());
    msg.extend_from_slice(&0u64.to_ne_bytes()); // unique: 0 for a notification
    msg.extend_from_slice(body);
    match rustix::io::write(fd, &msg) {
        Ok(_) => Ok(()),
        // An inode the kernel does not hold: nothing to take back.
        Err(rustix::io::Errno::NOENT) => Ok(()),
        // Unmounted: nothing is kept any more.
        Err(e @ (rustix::io::Errno::NODEV | rustix::io::Errno::NOTCONN)) => Err(e.into()),
        Err(e) => {
            warn!(code, "a cache notification to the kernel failed: {e}");
            Err(e.into())
        }
    }
}
