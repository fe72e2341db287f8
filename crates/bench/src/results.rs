//! `results.json`: everything a run measured, with the machine, the versions and
//! the git commit, so two runs can be compared (`commitfs bench compare`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::cost::{Cost, PriceModel};
use super::device::{DevCounters, DeviceInfo};
use super::measure::Peak;
use super::workloads::WorkResult;

pub const SCHEMA: u32 = 1;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    pub schema: u32,
    pub started_unix: u64,
    pub duration_secs: f64,
    pub quick: bool,
    pub command: String,
    pub machine: BTreeMap<String, String>,
    pub versions: BTreeMap<String, String>,
    pub git_commit: String,
    pub git_dirty: bool,
    pub device: Option<DeviceInfo>,
    pub price_model: PriceModel,
    pub systems: Vec<SystemOutcome>,
    pub workloads: Vec<WorkloadInfo>,
    pub runs: Vec<Run>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkloadInfo {
    pub id: String,
    pub description: String,
    /// How it ran ("fs_mark 3.3", "built-in postmark-like", ...), or why not.
    pub how: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SystemOutcome {
    pub id: String,
    pub label: String,
    /// ok, missing (not installed), failed, not selected.
    pub status: String,
    pub message: String,
    pub mkfs: String,
    pub mount: String,
    pub fsck: String,
    pub notes: Vec<String>,
    pub secs: f64,
}

/// Device writes classified by where they land (journal area, its fast-commit
/// tail, elsewhere), from the device's own request trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct JournalSplit {
    pub journal_writes: u64,
    pub journal_bytes: u64,
    pub fc_writes: u64,
    pub fc_bytes: u64,
    pub other_writes: u64,
    pub other_bytes: u64,
    pub flushes: u64,
    pub fua_writes: u64,
}

/// commitfs's own counters: `Fs::stats` (library pass) or `commitfs stats
/// --json` (through the mount).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CommitfsBreakdown {
    pub source: String,
    pub journal_mode: String,
    pub data_writes: u64,
    pub data_bytes: u64,
    pub metadata_writes: u64,
    pub metadata_bytes: u64,
    pub journal_writes: u64,
    pub journal_bytes: u64,
    pub fc_writes: u64,
    pub fc_bytes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub commits: u64,
    /// Fast commits (0 where the source does not count them).
    #[serde(default)]
    pub fc_commits: u64,
    pub log_blocks: u64,
    pub checkpoints: u64,
    pub revokes: u64,
    pub handles: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Cpu {
    /// CPU of the benchmark process (built-in workloads) or the tool (external).
    pub app_secs: f64,
    /// CPU of the file system's own process (commitfs / fuse2fs daemon) or
    /// kernel thread (ext4's jbd2); None where there is none to measure.
    pub fs_secs: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Run {
    pub system: String,
    /// "mount" (through the mounted file system) or "library" (commitfs `Fs`).
    pub pass: String,
    pub workload: String,
    pub variant: String,
    pub x: f64,
    pub error: Option<String>,
    pub result: WorkResult,
    pub device: DevCounters,
    pub journal: Option<JournalSplit>,
    pub commitfs: Option<CommitfsBreakdown>,
    /// `commitfs stats DIR --json` deltas, when that command exists.
    pub commitfs_stats: Option<serde_json::Value>,
    pub cpu: Cpu,
    pub peak: Peak,
    pub cost: Cost,
    /// A null request's round trip through the mount, µs: `getxattr` of a
    /// missing user xattr on the mount's root from one thread (the least of
    /// five batches), taken after the point. Through FUSE every request costs at
    /// least this; None in the library pass.
    #[serde(default)]
    pub null_rt_us: Option<f64>,
}

impl Run {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
    pub fn key(&self) -> (String, String, String, String) {
        (
            self.system.clone(),
            self.pass.clone(),
            self.workload.clone(),
            self.variant.clone(),
        )
    }
    /// Device bytes written per fsync (or per op if the run had no fsync).
    pub fn per_fsync(&self, v: u64) -> f64 {
        let d = if self.result.fsyncs > 0 {
            self.result.fsyncs
        } else {
            self.result.ops.max(1)
        };
        v as f64 / d as f64
    }
}
