//! Read-only memory maps of weight files: the one place in Tessera that maps a file.
//!
//! Mapping is `unsafe` because another process could truncate or rewrite the file while it
//! is mapped; kept here so that the loaders in `tessera-model` contain no `unsafe`.

use std::fs::File;
use std::path::Path;

pub use memmap2::Mmap;

/// Maps `path` read-only, asking for huge pages where the kernel backs file maps with them
/// (transparent huge pages for files; a hint, ignored elsewhere).
pub fn map_file(path: &Path) -> std::io::Result<Mmap> {
    let file = File::open(path)?;
    // SAFETY: the map is read-only and Tessera never writes weight files; a file truncated
    // by another process while mapped would fault on access, which is documented as
    // unsupported (model files must not change while a process serves them).
    let map = unsafe { Mmap::map(&file) }?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

/// Has the kernel map the pages that hold `bytes` (weights this process keeps, in a file's
/// map) now, reading them in if need be, rather than on their first touch: the first
/// forward pass then runs at the speed of the later ones instead of stopping on a page
/// fault every few pages. llama.cpp populates its whole map the same way. Only the bytes
/// a rank keeps: a tensor-parallel rank does not read the other ranks' parts of the file.
/// Linux (`MADV_POPULATE_READ`, 5.14 and later); elsewhere, or where it fails, the pages
/// fault in on first use as before.
pub fn prefault(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = bytes.as_ptr() as usize / page * page;
        let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
        if bytes.is_empty() || page == 0 {
            return;
        }
        // SAFETY: advice that reads the pages holding `bytes` (whole pages of the mapping
        // they lie in) and changes no memory; an error (an older kernel) leaves them as
        // they were.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_READ,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;

    /// Resident KiB of the mapping that starts at `addr`, from /proc/self/smaps.
    fn resident_kib(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines().skip_while(|l| {
            let start = l.split('-').next().unwrap_or("");
            usize::from_str_radix(start, 16) != Ok(addr)
        });
        assert!(lines.next().is_some(), "no mapping at {addr:#x}");
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn prefault_maps_the_pages_of_the_bytes_kept_and_no_others() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![7u8; 8 << 20]).unwrap();
        file.flush().unwrap();
        let map = map_file(file.path()).unwrap();
        let addr = map.as_ptr() as usize;
        let before = resident_kib(addr);
        assert!(before < 1024, "{before} KiB resident before any read");
        // 2 MiB in the middle, not page-aligned at either end: their pages (in 2 MiB huge
        // pages where the kernel gave the map those), and not the whole file.
        prefault(&map[(3 << 20) + 100..(5 << 20) + 100]);
        let after = resident_kib(addr);
        assert!(
            (2048..=4096).contains(&(after - before)),
            "{before} → {after} KiB resident"
        );
    }
}
