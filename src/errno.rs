//! The errno a shell user expects for each error. Every error type says its
//! own, beside its definition (`impl ToErrno`); the FUSE adapter asks once per
//! failed request and logs the error with its cause chain.

pub trait ToErrno {
    fn to_errno(&self) -> i32;
}

impl ToErrno for std::io::Error {
    /// The kernel's errno where there is one; EIO for errors made in process
    /// (a short read, a checksum that does not match).
    fn to_errno(&self) -> i32 {
        self.raw_os_error().unwrap_or(libc::EIO)
    }
}

/// An error and the causes under it ("error sending request" says little;
/// "operation timed out" or "connection refused" under it says what happened).
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}
