//! The device every system is measured on: a loop device over a sparse image file
//! (default), or the emulated device of [`super::emu`]. Counters always come from
//! the device (the loop device's block-layer statistics, or the emulated device's
//! own counters), never from the file system under test.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::emu::{self, Emulated, Profile, TraceRec};
use super::sys::{self, LoopDev, TempPath};

/// `--device KIND`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    Loop,
    Emulated(String),
}

impl DeviceKind {
    pub fn parse(s: &str) -> Result<DeviceKind> {
        match s {
            "loop" => Ok(DeviceKind::Loop),
            _ => {
                let p = s.strip_prefix("emulated:").unwrap_or(s);
                let p = if p == "emulated" { "sata-ssd" } else { p };
                emu::profile(p).map_err(|e| {
                    anyhow::anyhow!("--device {s}: {e}; use loop or emulated:PROFILE")
                })?;
                Ok(DeviceKind::Emulated(p.to_string()))
            }
        }
    }

    pub fn label(&self) -> String {
        match self {
            DeviceKind::Loop => "loop".into(),
            DeviceKind::Emulated(p) => format!("emulated:{p}"),
        }
    }
}

/// Device counters (cumulative; subtract two snapshots).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevCounters {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    /// FUA writes seen by the device (0 on loop devices: not counted there).
    pub fua_writes: u64,
    pub flushes: u64,
    /// Discards (trim) and write-zeroes requests.
    pub discards: u64,
    /// Emulated device: index of its request trace.
    pub trace_next: u64,
}

impl DevCounters {
    pub fn delta(&self, before: &DevCounters) -> DevCounters {
        DevCounters {
            reads: self.reads.saturating_sub(before.reads),
            read_bytes: self.read_bytes.saturating_sub(before.read_bytes),
            writes: self.writes.saturating_sub(before.writes),
            write_bytes: self.write_bytes.saturating_sub(before.write_bytes),
            fua_writes: self.fua_writes.saturating_sub(before.fua_writes),
            flushes: self.flushes.saturating_sub(before.flushes),
            discards: self.discards.saturating_sub(before.discards),
            trace_next: self.trace_next,
        }
    }
}

/// What the report says about the device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub kind: String,
    pub size_bytes: u64,
    pub path: String,
    pub profile: Option<Profile>,
    pub counters_from: String,
}

pub struct BenchDevice {
    pub kind: DeviceKind,
    pub dev: PathBuf,
    pub size: u64,
    emu: Option<Emulated>,
    loopdev: Option<LoopDev>,
    _image: Option<TempPath>,
}

impl BenchDevice {
    pub fn create(kind: &DeviceKind, size: u64, work: &Path) -> Result<BenchDevice> {
        match kind {
            DeviceKind::Loop => {
                let img = TempPath::new(work.join(format!("bench-{}.img", std::process::id())));
                let f = std::fs::File::create(&img.path)?;
                f.set_len(size)?;
                drop(f);
                let l = LoopDev::attach(&img.path)?;
                Ok(BenchDevice {
                    kind: kind.clone(),
                    dev: l.dev.clone(),
                    size,
                    emu: None,
                    loopdev: Some(l),
                    _image: Some(img),
                })
            }
            DeviceKind::Emulated(p) => {
                let prof = emu::profile(p)?;
                // 1 M requests of trace (32 MiB of shared memory).
                let e = Emulated::start(&prof, size, work, 1 << 20)?;
                Ok(BenchDevice {
                    kind: kind.clone(),
                    dev: e.dev.clone(),
                    size,
                    emu: Some(e),
                    loopdev: None,
                    _image: None,
                })
            }
        }
    }

    pub fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: self.kind.label(),
            size_bytes: self.size,
            path: self.dev.display().to_string(),
            profile: self.emu.as_ref().map(|e| e.profile.clone()),
            counters_from: match &self.emu {
                Some(_) => "the emulated device's own counters (nbdkit filter)".into(),
                None => format!(
                    "/sys/block/{}/stat (loop device, direct I/O to a sparse image file)",
                    self.name()
                ),
            },
        }
    }

    pub fn name(&self) -> String {
        self.dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    pub fn counters(&self) -> Result<DevCounters> {
        if let Some(e) = &self.emu {
            return Ok(from_emu(&e.counters()?));
        }
        loop_counters(&self.name())
    }

    /// A function reading the counters from another thread.
    pub fn counter_reader(&self) -> Box<dyn Fn() -> Result<DevCounters> + Send> {
        if let Some(e) = &self.emu {
            match e.counters_file() {
                Ok(f) => return Box::new(move || Ok(from_emu(&emu::read_counters(&f)?))),
                Err(e) => {
                    let msg = e.to_string();
                    return Box::new(move || bail!("{msg}"));
                }
            }
        }
        let name = self.name();
        Box::new(move || loop_counters(&name))
    }

    /// The device's request trace between two snapshots, if it keeps one.
    pub fn trace(&self, from: &DevCounters, to: &DevCounters) -> Option<Vec<TraceRec>> {
        let e = self.emu.as_ref()?;
        e.trace(from.trace_next, to.trace_next).ok().flatten()
    }

    pub fn has_trace(&self) -> bool {
        self.emu.is_some()
    }

    pub fn stop(mut self) {
        if let Some(e) = self.emu.take() {
            e.stop();
        }
        if let Some(l) = self.loopdev.take() {
            l.detach();
        }
    }
}

fn from_emu(c: &emu::EmuCounters) -> DevCounters {
    DevCounters {
        reads: c.reads,
        read_bytes: c.read_bytes,
        writes: c.writes,
        write_bytes: c.write_bytes,
        fua_writes: c.fua_writes,
        flushes: c.flushes,
        discards: c.trims + c.zeroes,
        trace_next: c.trace_next,
    }
}

fn loop_counters(name: &str) -> Result<DevCounters> {
    let s = sys::block_stat(name)?;
    Ok(DevCounters {
        reads: s.reads,
        read_bytes: s.read_sectors * 512,
        writes: s.writes,
        write_bytes: s.write_sectors * 512,
        fua_writes: 0,
        flushes: s.flushes,
        discards: s.discards,
        trace_next: 0,
    })
}

/// Check the device is usable at all (root, loop devices).
pub fn preflight(kind: &DeviceKind) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("commitfs bench needs root (mkfs, mount, loop devices)");
    }
    if !sys::have("losetup") {
        bail!("losetup not found (apt-get install util-linux)");
    }
    if let DeviceKind::Emulated(_) = kind {
        emu::available()?;
    }
    Ok(())
}
