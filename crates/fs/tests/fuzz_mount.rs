//! Bounded, deterministic run of the `mount_ops` fuzz case (commitfs_fs::fuzzing):
//! mutated images are mounted and used; no case may panic, hang or ask for an
//! unbounded allocation. `COMMITFS_FUZZ_CASES` and `COMMITFS_FUZZ_SEED` change the
//! number of cases and the first seed (long runs: `scripts/fuzz.sh stable CASES`,
//! or the cargo-fuzz target `mount_ops`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use commitfs_fs::fuzzing::{run_case, Templates, MAX_MUTATIONS};
use rand::{Rng, SeedableRng};

/// No single allocation may ask for more than this: sizes read from a corrupt
/// image must be checked before they size a buffer.
const ALLOC_CAP: usize = 64 << 20;
/// Live heap of the whole test binary (templates, a few image copies per case).
const LIVE_CAP: usize = 512 << 20;

/// The case being run (its seed), for the message of a refused allocation.
static CURRENT_SEED: AtomicU64 = AtomicU64::new(u64::MAX);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// Counts live bytes and refuses (with a message naming the case) requests over
/// the caps; a refusal aborts the test binary through `handle_alloc_error`.
struct Capped;

unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarding the caller's valid layout.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarding the caller's valid layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: ptr was allocated by System with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_CAP {
            refuse(new_size);
            return std::ptr::null_mut();
        }
        if new_size > layout.size() && !admit(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarding the caller's valid arguments.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > layout.size() {
                LIVE.fetch_sub(new_size - layout.size(), Ordering::Relaxed);
            }
        } else if new_size < layout.size() {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        p
    }
}

/// Account `n` more bytes, or refuse them.
fn admit(n: usize) -> bool {
    if n > ALLOC_CAP {
        refuse(n);
        return false;
    }
    LARGEST.fetch_max(n, Ordering::Relaxed);
    let live = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    if live > LIVE_CAP {
        LIVE.fetch_sub(n, Ordering::Relaxed);
        refuse(n);
        return false;
    }
    PEAK.fetch_max(live, Ordering::Relaxed);
    true
}

/// Say which case asked (without allocating: this runs inside the allocator).
fn refuse(n: usize) {
    let mut msg = [0u8; 160];
    let mut w = Cursor {
        buf: &mut msg,
        len: 0,
    };
    use std::fmt::Write;
    let _ = write!(
        w,
        "\nfuzz_mount: refused an allocation of {n} bytes (live {}) in case seed {}\n",
        LIVE.load(Ordering::Relaxed),
        CURRENT_SEED.load(Ordering::Relaxed)
    );
    let len = w.len;
    // SAFETY: writing initialised bytes of a local buffer to stderr.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), len);
    }
}

struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl std::fmt::Write for Cursor<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let b = s.as_bytes();
        let n = b.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
        Ok(())
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The fuzz input of case `seed`: a template byte and 1..=MAX_MUTATIONS mutations.
fn case_input(seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = rng.gen_range(1..=MAX_MUTATIONS.min(16));
    // Mostly few mutations: each one past a checksum failure rarely helps.
    let n = if rng.gen_bool(0.7) { n.min(4) } else { n };
    let mut v = vec![0u8; 1 + 7 * n];
    rng.fill(&mut v[..]);
    v
}

/// Per-case deadline: a case takes milliseconds; one that takes this long hangs.
const CASE_DEADLINE: Duration = Duration::from_secs(20);

#[test]
fn mutated_images_mount_and_serve_without_panic_hang_or_huge_allocation() {
    let cases = env_u64("COMMITFS_FUZZ_CASES", 2500);
    let first = env_u64("COMMITFS_FUZZ_SEED", 1);
    let tmp = tempfile::tempdir().unwrap();
    let templates = Arc::new(Templates::build(tmp.path()).expect("build templates"));
    for t in &templates.all {
        eprintln!(
            "template {}: {} metadata blocks {:?}...",
            t.name,
            t.meta_blocks.len(),
            &t.meta_blocks[..t.meta_blocks.len().min(40)]
        );
        assert!(
            t.meta_blocks.len() > 20,
            "{}: only {} metadata blocks traced",
            t.name,
            t.meta_blocks.len()
        );
    }
    // The unmutated templates must mount and survive the whole mix (3 mounts
    // each): otherwise the run below would only test mount errors.
    for i in 0..templates.all.len() {
        assert_eq!(run_case(&templates, &[i as u8]), 3, "template {i}");
    }
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut mounted = [0u64; 4];
    for seed in first..first + cases {
        CURRENT_SEED.store(seed, Ordering::Relaxed);
        let input = case_input(seed);
        let t = templates.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("case-{seed}"))
            .spawn(move || {
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(&t, &input)));
                let _ = tx.send(r);
            })
            .unwrap();
        match rx.recv_timeout(CASE_DEADLINE) {
            Ok(Ok(m)) => mounted[m.min(3)] += 1,
            Ok(Err(p)) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("seed {seed}: panic: {msg}"));
            }
            Err(_) => {
                // The thread cannot be stopped; report and stop the run.
                failures.push(format!(
                    "seed {seed}: no result after {CASE_DEADLINE:?} (hang)"
                ));
                break;
            }
        }
    }
    let took = start.elapsed();
    eprintln!(
        "fuzz_mount: {cases} cases from seed {first} in {took:.1?}; mounts per case \
         0/1/2/3: {mounted:?}; largest allocation {} KiB, peak live {} MiB",
        LARGEST.load(Ordering::Relaxed) >> 10,
        PEAK.load(Ordering::Relaxed) >> 20
    );
    assert!(
        failures.is_empty(),
        "{} failing cases (rerun one with COMMITFS_FUZZ_SEED=S COMMITFS_FUZZ_CASES=1):\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The run must reach past mounting in most cases, or it tests little.
    assert!(
        mounted[1] + mounted[2] + mounted[3] > cases / 3,
        "too few cases mounted: {mounted:?}"
    );
}
