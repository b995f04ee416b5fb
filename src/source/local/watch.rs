//! Writes by other programs to a mapped source, seen as they happen
//! (inotify): a program that rewrites the file in place and puts its size and
//! modification time back (`rsync --inplace -t`, `cp --preserve=timestamps`
//! over it, `os.utime`) changes nothing `stat` shows, but its writes are
//! seen. A `chmod` or `chown` alone is not a write.
//!
//! One inotify descriptor for the process, read only when asked (no thread):
//! events are taken off it by whoever asks whether a file changed. The
//! daemon's own in-place commits write under a write lease (no other
//! program can have the file open for writing then): what is seen between
//! `begin_own` and `end_own` is theirs and taken as such.

use crate::sync::LockAnyway;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rustix::fs::inotify;
use tracing::warn;

struct Watcher {
    fd: OwnedFd,
    /// The flags of the files each watch stands for (a file's watch is one
    /// per inode: every `Watch` of it shares it).
    flags: HashMap<i32, Vec<Weak<AtomicBool>>>,
    /// Watches of files this daemon writes now (in-place commits): their
    /// writes are not another program's.
    ours: HashMap<i32, usize>,
}

fn watcher() -> Option<&'static Mutex<Watcher>> {
    static WATCHER: OnceLock<Option<Mutex<Watcher>>> = OnceLock::new();
    WATCHER
        .get_or_init(|| {
            let flags = inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC;
            match inotify::init(flags) {
                Ok(fd) => Some(Mutex::new(Watcher {
                    fd,
                    flags: HashMap::new(),
                    ours: HashMap::new(),
                })),
                Err(e) => {
                    warn!("inotify: {e}: a source rewritten in place with its time put back is not seen");
                    None
                }
            }
        })
        .as_ref()
}

impl Watcher {
    /// Takes every event off the descriptor and marks the files written.
    fn drain(&mut self) {
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(&self.fd, &mut buf);
        let mut written = Vec::new();
        let mut overflow = false;
        loop {
            match reader.next() {
                Ok(event) => {
                    let mask = event.events();
                    if mask.contains(inotify::ReadFlags::QUEUE_OVERFLOW) {
                        overflow = true;
                    } else if mask.contains(inotify::ReadFlags::MODIFY) {
                        written.push(event.wd());
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                // (AGAIN: nothing more to read.)
                Err(_) => break,
            }
        }
        for (wd, flags) in &self.flags {
            // Events were lost: every file may have been written.
            if (overflow || written.contains(wd)) && !self.ours.contains_key(wd) {
                flags
                    .iter()
                    .filter_map(Weak::upgrade)
                    .for_each(|f| f.store(true, Ordering::SeqCst));
            }
        }
    }
}

/// A watch of one open file for writes by other programs.
pub struct Watch {
    wd: i32,
    changed: Arc<AtomicBool>,
}

impl Watch {
    /// Watches `file` (None where inotify cannot: the check falls back to
    /// the file's size and time).
    pub fn of(file: &File) -> Option<Watch> {
        let mut w = watcher()?.lock_anyway();
        // (The link in /proc names exactly this open file's inode.)
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let wd = match inotify::add_watch(&w.fd, path.as_str(), inotify::WatchFlags::MODIFY) {
            Ok(wd) => wd,
            Err(e) => {
                warn!(
                    "inotify: watching {path}: {e}: a source rewritten in place with its time put back is not seen"
                );
                return None;
            }
        };
        // Events of an earlier watch of the same inode belong to it, not here.
        w.drain();
        let changed = Arc::new(AtomicBool::new(false));
        let flags = w.flags.entry(wd).or_default();
        flags.retain(|f| f.strong_count() > 0);
        flags.push(Arc::downgrade(&changed));
        Some(Watch { wd, changed })
    }

    /// Whether another program wrote the file since it was watched.
    pub fn changed(&self) -> bool {
        if let Some(w) = watcher() {
            w.lock_anyway().drain();
        }
        self.changed.load(Ordering::SeqCst)
    }

    /// This daemon starts writing the file (under its lease): what was
    /// written before is another program's; what is written now is ours.
    pub fn begin_own(&self) {
        if let Some(w) = watcher() {
            let mut w = w.lock_anyway();
            w.drain();
            *w.ours.entry(self.wd).or_default() += 1;
        }
    }

    /// This daemon's writes are done (all of them seen by now: inotify
    /// queues an event as the write is made). `settled`: the file is now as
    /// this daemon left it (a commit landed, forced or not): what another
    /// program wrote before is in the past.
    pub fn end_own(&self, settled: bool) {
        if settled {
            self.changed.store(false, Ordering::SeqCst);
        }
        if let Some(w) = watcher() {
            let mut w = w.lock_anyway();
            w.drain();
            if let Some(n) = w.ours.get_mut(&self.wd) {
                *n -= 1;
                if *n == 0 {
                    w.ours.remove(&self.wd);
                }
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(w) = watcher() {
            let mut w = w.lock_anyway();
            let gone = match w.flags.get_mut(&self.wd) {
                Some(flags) => {
                    let mine = Arc::as_ptr(&self.changed);
                    flags.retain(|f| f.strong_count() > 0 && f.as_ptr() != mine);
                    flags.is_empty()
                }
                None => false,
            };
            if gone {
                w.flags.remove(&self.wd);
                let _ = inotify::remove_watch(&w.fd, self.wd);
            }
        }
    }
}
