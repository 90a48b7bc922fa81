//! Shared-memory segments under `/dev/shm`, for ranks on one host: the one place in Tessera
//! that maps memory shared between processes and calls `futex`.
//!
//! A [`ShmSegment`] is a file under `/dev/shm` mapped `MAP_SHARED` into every process that
//! opens it. Its layout ([`ShmLayout`]) is two regions:
//! - the control region, `control_words` × [`AtomicU32`], for counters and flags; a waiter
//!   sleeps on one of them with [`futex_wait`] and is woken by [`futex_wake`];
//! - the data region, `data_bytes` rounded up to whole [`AtomicU64`] words, for payloads,
//!   copied in and out with [`ShmSegment::write_f32`], [`ShmSegment::add_f32`] and friends.
//!
//! **Every access to the mapping is atomic** (relaxed for payload words). Another process
//! can write the segment at any time, and no Rust type can stop it; with atomic accesses a
//! peer that breaks the protocol produces wrong values, never undefined behaviour. The
//! users' protocol orders the payload words with release/acquire operations on the control
//! words. Relaxed 8-byte atomics compile to plain moves on x86-64 and aarch64, so a copy
//! costs about what `memcpy` does once the data is out of cache. The regions never overlap
//! and each is accessed at one width only (no mixed-size atomics).
//!
//! The segment's creator unlinks its file on drop; mappings held by other processes stay
//! valid until they drop theirs. A file truncated by another process of the same user while
//! mapped would fault on access (`SIGBUS`); that is outside the contract, as for
//! [`crate::mmap`].

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};

/// Where segments live: the tmpfs every Linux host mounts for POSIX shared memory.
const SHM_DIR: &str = "/dev/shm";

/// The control region is padded to a cache line so the first payload word does not share a
/// line with the counters that ranks poll.
const CONTROL_ALIGN_BYTES: usize = 64;

/// Sizes of a segment's two regions. Every process that opens a segment passes the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmLayout {
    /// Number of [`AtomicU32`] control words.
    pub control_words: usize,
    /// Payload bytes; rounded up to a multiple of 8.
    pub data_bytes: usize,
}

impl ShmLayout {
    fn control_bytes(self) -> usize {
        (self.control_words * 4).next_multiple_of(CONTROL_ALIGN_BYTES)
    }

    fn data_words(self) -> usize {
        self.data_bytes.div_ceil(8)
    }

    /// Bytes of the whole file.
    pub fn total_bytes(self) -> usize {
        self.control_bytes() + self.data_words() * 8
    }
}

/// A copy that does not fit the data region, or starts off an 8-byte boundary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "shared-memory range at byte {offset_bytes} of {len_bytes} bytes does not fit a data \
     region of {capacity_bytes} bytes (offsets must be multiples of 8)"
)]
pub struct ShmRangeError {
    pub offset_bytes: usize,
    pub len_bytes: usize,
    pub capacity_bytes: usize,
}

/// A mapped shared-memory segment. See the module docs for its layout and contract.
#[derive(Debug)]
pub struct ShmSegment {
    map: MmapRaw,
    /// Kept open so [`ShmSegment::is_unlinked`] can ask the kernel about this very file.
    file: File,
    path: PathBuf,
    layout: ShmLayout,
    /// Created by this handle: unlink on drop.
    owner: bool,
}

impl ShmSegment {
    /// Creates segment `name` exclusively (`O_EXCL`, mode 0600), sized for `layout` and
    /// zero-filled. Fails with `AlreadyExists` if the name is taken.
    pub fn create(name: &str, layout: ShmLayout) -> io::Result<ShmSegment> {
        let path = segment_path(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let total = layout.total_bytes();
        let mapped = file
            .set_len(total as u64)
            .and_then(|()| MmapOptions::new().len(total).map_raw(&file));
        match mapped {
            Ok(map) => Ok(ShmSegment {
                map,
                file,
                path,
                layout,
                owner: true,
            }),
            Err(e) => {
                // Best effort: the error that matters is the one above.
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Opens an existing segment `name` laid out as `layout`. `NotFound` if it does not
    /// exist; `InvalidData` if it is smaller than `layout` needs.
    pub fn open(name: &str, layout: ShmLayout) -> io::Result<ShmSegment> {
        let path = segment_path(name)?;
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        let total = layout.total_bytes();
        let len = file.metadata()?.len();
        if len < total as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment {name} has {len} bytes, expected {total}"),
            ));
        }
        let map = MmapOptions::new().len(total).map_raw(&file)?;
        Ok(ShmSegment {
            map,
            file,
            path,
            layout,
            owner: false,
        })
    }

    /// Removes segment `name` if it exists (a stale one from an earlier run). Processes
    /// that have it mapped keep their mapping. Returns whether a file was removed.
    pub fn remove(name: &str) -> io::Result<bool> {
        match std::fs::remove_file(segment_path(name)?) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Atomically renames this segment to `name`, replacing a segment of that name (whose
    /// openers then see [`ShmSegment::is_unlinked`]). Lets a creator fill a segment under a
    /// private name and publish it complete.
    pub fn rename(&mut self, name: &str) -> io::Result<()> {
        let path = segment_path(name)?;
        std::fs::rename(&self.path, &path)?;
        self.path = path;
        Ok(())
    }

    /// Whether this segment's file no longer has a name (removed or replaced), so that no
    /// new process can join it.
    pub fn is_unlinked(&self) -> io::Result<bool> {
        Ok(self.file.metadata()?.nlink() == 0)
    }

    pub fn layout(&self) -> ShmLayout {
        self.layout
    }

    /// The control words.
    pub fn control(&self) -> &[AtomicU32] {
        let ptr = self.map.as_ptr().cast::<AtomicU32>();
        // SAFETY: the mapping is page-aligned (so 4-aligned), at least
        // `layout.total_bytes()` long (checked at create/open), and lives as long as `self`;
        // the control region is its first `control_words * 4` bytes. `AtomicU32` has the
        // size and alignment of `u32`, accepts every bit pattern, and allows shared
        // mutation, so concurrent writes by other processes do not invalidate the `&`.
        // The data region, the only other view, does not overlap it.
        unsafe { std::slice::from_raw_parts(ptr, self.layout.control_words) }
    }

    /// The data region as 8-byte words.
    pub fn words(&self) -> &[AtomicU64] {
        // `map_raw` maps `total_bytes` bytes, so this offset is in bounds.
        let ptr = self
            .map
            .as_ptr()
            .wrapping_add(self.layout.control_bytes())
            .cast::<AtomicU64>();
        // SAFETY: the data region starts `control_bytes()` (a multiple of 64) after the
        // page-aligned start of the mapping, so it is 8-aligned, and its
        // `data_words() * 8` bytes end exactly at `total_bytes()`, the mapped length. The
        // mapping lives as long as `self`. `AtomicU64` accepts every bit pattern and
        // allows shared mutation. It does not overlap the control region.
        unsafe { std::slice::from_raw_parts(ptr, self.layout.data_words()) }
    }

    /// Data bytes this segment holds (a multiple of 8).
    pub fn data_capacity_bytes(&self) -> usize {
        self.layout.data_words() * 8
    }

    /// The words covering `len_bytes` bytes from `offset_bytes`, checked.
    fn range(&self, offset_bytes: usize, len_bytes: usize) -> Result<&[AtomicU64], ShmRangeError> {
        let error = || ShmRangeError {
            offset_bytes,
            len_bytes,
            capacity_bytes: self.data_capacity_bytes(),
        };
        if !offset_bytes.is_multiple_of(8) {
            return Err(error());
        }
        let first = offset_bytes / 8;
        let end = first.checked_add(len_bytes.div_ceil(8)).ok_or_else(error)?;
        self.words().get(first..end).ok_or_else(error)
    }

    /// Stores `src` at `offset_bytes` of the data region (two values per word; an odd
    /// tail fills the low half of its word).
    pub fn write_f32(&self, offset_bytes: usize, src: &[f32]) -> Result<(), ShmRangeError> {
        let words = self.range(offset_bytes, src.len() * 4)?;
        let pairs = src.chunks_exact(2);
        let tail = pairs.remainder();
        for (word, pair) in words.iter().zip(pairs) {
            word.store(pack(pair[0], pair[1]), Ordering::Relaxed);
        }
        if let [last] = tail {
            words[words.len() - 1].store(pack(*last, 0.0), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Loads `dst.len()` values from `offset_bytes` into `dst`.
    pub fn read_f32(&self, offset_bytes: usize, dst: &mut [f32]) -> Result<(), ShmRangeError> {
        self.combine_f32(offset_bytes, dst, |_, x| x)
    }

    /// Adds `dst.len()` values from `offset_bytes` into `dst` (`dst[i] += shm[i]`), so a
    /// reduction reads each rank's slot once without a temporary copy.
    pub fn add_f32(&self, offset_bytes: usize, dst: &mut [f32]) -> Result<(), ShmRangeError> {
        self.combine_f32(offset_bytes, dst, |acc, x| acc + x)
    }

    fn combine_f32(
        &self,
        offset_bytes: usize,
        dst: &mut [f32],
        f: impl Fn(f32, f32) -> f32,
    ) -> Result<(), ShmRangeError> {
        let words = self.range(offset_bytes, dst.len() * 4)?;
        let mut pairs = dst.chunks_exact_mut(2);
        for (word, pair) in words.iter().zip(&mut pairs) {
            let (lo, hi) = unpack(word.load(Ordering::Relaxed));
            pair[0] = f(pair[0], lo);
            pair[1] = f(pair[1], hi);
        }
        if let [last] = pairs.into_remainder() {
            let (lo, _) = unpack(words[words.len() - 1].load(Ordering::Relaxed));
            *last = f(*last, lo);
        }
        Ok(())
    }

    /// Stores `src` at `offset_bytes` of the data region (a partial last word is
    /// zero-padded).
    pub fn write_bytes(&self, offset_bytes: usize, src: &[u8]) -> Result<(), ShmRangeError> {
        let words = self.range(offset_bytes, src.len())?;
        for (word, chunk) in words.iter().zip(src.chunks(8)) {
            let mut bytes = [0u8; 8];
            bytes[..chunk.len()].copy_from_slice(chunk);
            word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Loads `dst.len()` bytes from `offset_bytes` into `dst`.
    pub fn read_bytes(&self, offset_bytes: usize, dst: &mut [u8]) -> Result<(), ShmRangeError> {
        let words = self.range(offset_bytes, dst.len())?;
        for (word, chunk) in words.iter().zip(dst.chunks_mut(8)) {
            let bytes = word.load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
        Ok(())
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        if self.owner {
            // Best effort: a segment already removed (replaced by a newer creator) is fine.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn pack(lo: f32, hi: f32) -> u64 {
    u64::from(lo.to_bits()) | (u64::from(hi.to_bits()) << 32)
}

fn unpack(word: u64) -> (f32, f32) {
    // Truncation keeps the low half, by design.
    (
        f32::from_bits(word as u32),
        f32::from_bits((word >> 32) as u32),
    )
}

/// `/dev/shm/<name>`, refusing names that would leave the directory.
fn segment_path(name: &str) -> io::Result<PathBuf> {
    let valid = !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && !name.contains(['/', '\0']);
    if !valid {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("shared-memory name {name:?} must be 1..=200 bytes without '/'"),
        ));
    }
    Ok(PathBuf::from(SHM_DIR).join(name))
}

/// How a [`futex_wait`] ended. All of them mean "check your condition again".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FutexWait {
    /// Woken by [`futex_wake`] (or spuriously).
    Woken,
    /// The word did not hold `expected` when the kernel looked.
    Changed,
    TimedOut,
    /// A signal arrived.
    Interrupted,
}

/// Sleeps while `word` holds `expected`, for at most `timeout`. Works across processes
/// (`FUTEX_WAIT` without the private flag) when `word` lies in a shared segment.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> FutexWait {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 1e9, so it fits every `c_long`.
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the aligned 4-byte word at `word.as_ptr()`, valid for the
    // whole call because `word` is borrowed; `&ts` is a valid timespec for the call; the
    // remaining arguments are ignored by FUTEX_WAIT. The kernel writes no user memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if rc == 0 {
        return FutexWait::Woken;
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => FutexWait::Changed,
        Some(libc::ETIMEDOUT) => FutexWait::TimedOut,
        // EINTR, and anything unexpected: the caller re-checks its condition and deadline.
        _ => FutexWait::Interrupted,
    }
}

/// Wakes up to `waiters` threads (of any process) sleeping on `word`; returns how many woke.
pub fn futex_wake(word: &AtomicU32, waiters: u32) -> u32 {
    let count = libc::c_int::try_from(waiters).unwrap_or(libc::c_int::MAX);
    // SAFETY: FUTEX_WAKE only uses the address of `word` as a key (it is aligned and
    // borrowed for the call) and the count; it reads and writes no user memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            count,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    u32::try_from(rc).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    use super::*;

    fn unique_name(tag: &str) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        format!("tessera-kernels-test-{tag}-{}-{n}", std::process::id())
    }

    const LAYOUT: ShmLayout = ShmLayout {
        control_words: 5,
        data_bytes: 100,
    };

    #[test]
    fn two_mappings_share_control_words_and_data() {
        let name = unique_name("share");
        let a = ShmSegment::create(&name, LAYOUT).unwrap();
        let b = ShmSegment::open(&name, LAYOUT).unwrap();
        assert_eq!(a.data_capacity_bytes(), 104);
        a.control()[4].store(7, Ordering::SeqCst);
        assert_eq!(b.control()[4].load(Ordering::SeqCst), 7);

        let values = [1.5f32, -2.0, 3.25];
        a.write_f32(8, &values).unwrap();
        let mut out = [0.0f32; 3];
        b.read_f32(8, &mut out).unwrap();
        assert_eq!(out, values);
        b.add_f32(8, &mut out).unwrap();
        assert_eq!(out, [3.0, -4.0, 6.5]);

        let bytes: Vec<u8> = (0..13).collect();
        b.write_bytes(88, &bytes).unwrap();
        let mut back = [0u8; 13];
        a.read_bytes(88, &mut back).unwrap();
        assert_eq!(back.as_slice(), bytes.as_slice());
    }

    #[test]
    fn ranges_are_checked() {
        let seg = ShmSegment::create(&unique_name("range"), LAYOUT).unwrap();
        assert!(seg.write_f32(4, &[1.0]).is_err(), "unaligned offset");
        assert!(seg.write_bytes(96, &[0; 9]).is_err(), "past the end");
        assert!(seg.write_bytes(96, &[0; 8]).is_ok());
        assert!(seg.read_f32(usize::MAX - 7, &mut [0.0; 4]).is_err());
    }

    #[test]
    fn create_is_exclusive_and_the_creator_unlinks() {
        let name = unique_name("excl");
        let seg = ShmSegment::create(&name, LAYOUT).unwrap();
        let again = ShmSegment::create(&name, LAYOUT).unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::AlreadyExists);
        let opener = ShmSegment::open(&name, LAYOUT).unwrap();
        drop(seg);
        assert_eq!(
            ShmSegment::open(&name, LAYOUT).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        assert!(opener.is_unlinked().unwrap());
        assert!(ShmSegment::open("../etc", LAYOUT).is_err());
    }

    #[test]
    fn open_refuses_a_segment_that_is_too_small() {
        let name = unique_name("small");
        let _seg = ShmSegment::create(&name, LAYOUT).unwrap();
        let bigger = ShmLayout {
            data_bytes: 4096,
            ..LAYOUT
        };
        let err = ShmSegment::open(&name, bigger).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn rename_replaces_and_unlinks_the_old_segment() {
        let (name, staging) = (unique_name("pub"), unique_name("staging"));
        let stale = ShmSegment::create(&name, LAYOUT).unwrap();
        let mut fresh = ShmSegment::create(&staging, LAYOUT).unwrap();
        fresh.control()[0].store(42, Ordering::SeqCst);
        fresh.rename(&name).unwrap();
        assert!(stale.is_unlinked().unwrap());
        let opened = ShmSegment::open(&name, LAYOUT).unwrap();
        assert_eq!(opened.control()[0].load(Ordering::SeqCst), 42);
        assert!(!ShmSegment::remove(&staging).unwrap());
    }

    #[test]
    fn futex_wait_times_out_sees_changes_and_is_woken() {
        let name = unique_name("futex");
        let seg = ShmSegment::create(&name, LAYOUT).unwrap();
        let word = &seg.control()[0];
        let started = Instant::now();
        assert_eq!(
            futex_wait(word, 0, Duration::from_millis(20)),
            FutexWait::TimedOut
        );
        assert!(started.elapsed() >= Duration::from_millis(15));
        assert_eq!(
            futex_wait(word, 1, Duration::from_secs(1)),
            FutexWait::Changed
        );

        let other = ShmSegment::open(&name, LAYOUT).unwrap();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.control()[0].store(1, Ordering::SeqCst);
            futex_wake(&other.control()[0], u32::MAX)
        });
        let started = Instant::now();
        while word.load(Ordering::SeqCst) == 0 {
            futex_wait(word, 0, Duration::from_secs(5));
        }
        assert!(started.elapsed() < Duration::from_secs(2));
        waker.join().unwrap();
    }
}
