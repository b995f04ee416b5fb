//! The write lease an in-place commit holds on the source: the kernel
//! refuses it while any other open of the file exists, and breaks it (after
//! `lease-break-time`) when another program opens the file.

use super::*;

/// A write lease on the daemon's own descriptor of a source: while it is
/// held, no other program has the file open or mapped, and an open by one
/// waits (up to /proc/sys/fs/lease-break-time) until it is released.
pub struct Lease {
    file: Arc<File>,
    taken: std::time::Instant,
}

impl Lease {
    pub fn take(file: &Arc<File>) -> Result<Lease, crate::checkpoint::Declined> {
        // An open by another program sends the holder SIGIO, whose default
        // action kills: stfs asks F_GETLEASE instead (`unbroken`).
        static IGNORE_SIGIO: std::sync::Once = std::sync::Once::new();
        // SAFETY: setting a signal to be ignored.
        IGNORE_SIGIO.call_once(|| unsafe {
            libc::signal(libc::SIGIO, libc::SIG_IGN);
        });
        // SAFETY: fcntl on a valid descriptor.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EAGAIN) => "another program has it open or mapped".into(),
                _ => format!("no write lease on it ({e})").into(),
            });
        }
        Ok(Lease {
            file: file.clone(),
            taken: std::time::Instant::now(),
        })
    }

    /// Whether no other program can have the file open: the lease is whole,
    /// or an open is waiting for it to be let go (a break pending), which
    /// the kernel grants only after /proc/sys/fs/lease-break-time.
    pub fn holds(&self) -> bool {
        // SAFETY: fcntl on a valid descriptor.
        if unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_GETLEASE) } == libc::F_WRLCK {
            return true;
        }
        let break_time = std::fs::read_to_string("/proc/sys/fs/lease-break-time")
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        // A margin: the commit writes only after this check.
        self.taken.elapsed() + std::time::Duration::from_secs(2)
            < std::time::Duration::from_secs(break_time)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // SAFETY: fcntl on a valid descriptor.
        unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
    }
}
