//! Mounting as a normal user through the setuid `fusermount3`, which passes
//! back the /dev/fuse descriptor over a socket (the libfuse protocol:
//! `_FUSE_COMMFD`, SCM_RIGHTS). fuser opens /dev/fuse itself before it tries
//! fusermount, which fails where /dev/fuse is not world-accessible.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

pub fn mount(mountpoint: &Path, options: &str) -> std::io::Result<OwnedFd> {
    let mut sv = [0; 2];
    // SAFETY: sv is a valid out-array of two ints.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sv.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two fresh descriptors that we now own.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    // Only fusermount3's end may be inherited.
    // SAFETY: setting a descriptor flag on our own fd.
    unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    let output = std::process::Command::new("fusermount3")
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .arg("-o")
        .arg(options)
        .arg("--")
        .arg(mountpoint)
        .output()
        .map_err(|e| std::io::Error::new(e.kind(), format!("fusermount3: {e}")))?;
    drop(theirs);
    if !output.status.success() {
        return Err(std::io::Error::other(format!(
            "fusermount3: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    receive_fd(&ours)
}

/// Receives one descriptor sent with SCM_RIGHTS.
fn receive_fd(socket: &OwnedFd) -> std::io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one cmsghdr carrying one int, suitably aligned.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen =
        unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    loop {
        // SAFETY: msg points at live buffers of the sizes it states.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n > 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return Err(if n == 0 {
            std::io::Error::other("fusermount3 sent no descriptor")
        } else {
            e
        });
    }
    // SAFETY: msg was filled by recvmsg; CMSG_* walk its control buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(std::io::Error::other("fusermount3 sent no descriptor"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

pub fn unmount(mountpoint: &Path, lazy: bool) -> std::io::Result<()> {
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-u");
    if lazy {
        cmd.arg("-z");
    }
    let out = cmd.arg("--").arg(mountpoint).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}
