//! Mounting as a normal user through the setuid `fusermount3`, which passes
//! back the /dev/fuse descriptor over a socket (the libfuse protocol:
//! `_FUSE_COMMFD`, SCM_RIGHTS). fuser opens /dev/fuse itself before it tries
//! fusermount, which fails where /dev/fuse is not world-accessible.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SocketFlags, SocketType,
    recvmsg, socketpair,
};

pub fn mount(mountpoint: &Path, options: &str) -> std::io::Result<OwnedFd> {
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::empty(),
        None,
    )?;
    // Only fusermount3's end may be inherited.
    rustix::io::fcntl_setfd(&ours, rustix::io::FdFlags::CLOEXEC)?;
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
    let none = || std::io::Error::other("fusermount3 sent no descriptor");
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    loop {
        let mut iov = [std::io::IoSliceMut::new(&mut byte)];
        match recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(got) if got.bytes > 0 => break,
            Ok(_) => return Err(none()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = message {
            if let Some(fd) = fds.next() {
                return Ok(fd);
            }
        }
    }
    Err(none())
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
