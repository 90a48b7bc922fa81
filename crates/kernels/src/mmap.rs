//! Read-only memory maps of weight files: the one place in Tessera that maps a file.
//!
//! Mapping is `unsafe` because another process could truncate or rewrite the file while it
//! is mapped; kept here so that the loaders in `tessera-model` contain no `unsafe`.

use std::fs::File;
use std::path::Path;

pub use memmap2::Mmap;

/// Maps `path` read-only.
pub fn map_file(path: &Path) -> std::io::Result<Mmap> {
    let file = File::open(path)?;
    // SAFETY: the map is read-only and Tessera never writes weight files; a file truncated
    // by another process while mapped would fault on access, which is documented as
    // unsupported (model files must not change while a process serves them).
    unsafe { Mmap::map(&file) }
}
