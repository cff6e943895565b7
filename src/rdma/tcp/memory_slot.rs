//! The data server's destination memory, swappable while the target is paused (sleep mode's
//! resume on new memory, DESIGN.md §7). A write takes the memory once, after its admission,
//! and uses only that for its whole course; every byte it copies is inside its permit's gate.
//! A swap happens only while paused: no permit is open, so a write admitted before the pause
//! can never pass its gate again and never touches the memory it took, and every write
//! admitted after the resume took the new memory.

#![forbid(unsafe_code)]

use std::sync::{Arc, RwLock};

use crate::rdma::memory::RegisteredMemory;

/// The memory writes land in now.
#[derive(Debug)]
pub struct MemorySlot(RwLock<Arc<RegisteredMemory>>);

impl MemorySlot {
    /// Start with `memory`.
    pub fn new(memory: Arc<RegisteredMemory>) -> Self {
        MemorySlot(RwLock::new(memory))
    }

    /// The memory now (one lock per write, not per socket read).
    pub fn current(&self) -> Arc<RegisteredMemory> {
        Arc::clone(&self.0.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Put `memory` in place; returns the old one. Only while no permit is open (paused):
    /// the old memory stays alive while a revoked write still holds it, unread.
    pub fn replace(&self, memory: Arc<RegisteredMemory>) -> Arc<RegisteredMemory> {
        std::mem::replace(
            &mut *self.0.write().unwrap_or_else(|e| e.into_inner()),
            memory,
        )
    }
}
