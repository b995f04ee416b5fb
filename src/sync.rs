//! Locks that outlive a panic: a thread that panics while holding one leaves
//! the data as it was written so far, and the rest of the daemon goes on
//! (every holder keeps its data consistent before anything can panic).

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub trait LockAnyway<T: ?Sized> {
    /// `lock()`, taking the guard even from a poisoned lock.
    fn lock_anyway(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockAnyway<T> for Mutex<T> {
    fn lock_anyway(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub trait RwLockAnyway<T: ?Sized> {
    /// `read()`, taking the guard even from a poisoned lock.
    fn read_anyway(&self) -> RwLockReadGuard<'_, T>;
    /// `write()`, taking the guard even from a poisoned lock.
    fn write_anyway(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockAnyway<T> for RwLock<T> {
    fn read_anyway(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write_anyway(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|p| p.into_inner())
    }
}
