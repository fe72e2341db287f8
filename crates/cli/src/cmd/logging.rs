//! Where the mount daemon's log goes.
//!
//! A daemon has no terminal once it detaches, so by default it logs to the system
//! log: the systemd journal where journald runs, else syslog through `/dev/log`.
//! `--log-file` appends to a file instead; `--foreground` logs to stderr. Colour
//! codes are only written to a terminal. Normal operation logs at `info` and
//! below: nothing at `warn` unless something is wrong.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// The journal's native socket (present where systemd-journald runs).
const JOURNALD_SOCKET: &str = "/run/systemd/journal/socket";
/// The traditional syslog socket; `COMMITFS_SYSLOG_SOCKET` names another one.
const SYSLOG_SOCKET: &str = "/dev/log";

/// A log destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogSink {
    /// Append to this file (no colour codes).
    File(PathBuf),
    /// The systemd journal.
    Journald,
    /// Syslog datagrams (RFC 3164) to this Unix socket.
    Syslog(PathBuf),
    /// Standard error (colour only on a terminal).
    Stderr,
}

impl LogSink {
    /// The destination for a daemon: the file if asked, else the journal, else
    /// syslog, else stderr (which is only useful until the daemon detaches).
    pub fn for_daemon(log_file: Option<&Path>) -> LogSink {
        if let Some(p) = log_file {
            return LogSink::File(p.to_path_buf());
        }
        let custom = std::env::var_os("COMMITFS_SYSLOG_SOCKET").map(PathBuf::from);
        if custom.is_none() && Path::new(JOURNALD_SOCKET).exists() {
            return LogSink::Journald;
        }
        let syslog = custom.unwrap_or_else(|| PathBuf::from(SYSLOG_SOCKET));
        if syslog.exists() {
            return LogSink::Syslog(syslog);
        }
        LogSink::Stderr
    }

    /// The destination for `--foreground`: the file if asked, else stderr.
    pub fn for_foreground(log_file: Option<&Path>) -> LogSink {
        match log_file {
            Some(p) => LogSink::File(p.to_path_buf()),
            None => LogSink::Stderr,
        }
    }

    /// For the startup message.
    pub fn describe(&self) -> String {
        match self {
            LogSink::File(p) => format!("log file {}", p.display()),
            LogSink::Journald => "the systemd journal".into(),
            LogSink::Syslog(p) => format!("syslog ({})", p.display()),
            LogSink::Stderr => "stderr".into(),
        }
    }
}

/// The level filter: `COMMITFS_LOG` or `RUST_LOG` if set, else `info` (`warn` if
/// `quiet`). fuser's "Mounting"/"Failed to umount" messages are silenced: after a
/// kernel-side `umount` fuser's own second unmount attempt fails harmlessly and
/// would warn on every normal unmount (we log mount and unmount ourselves).
fn filter(quiet: bool) -> EnvFilter {
    EnvFilter::try_from_env("COMMITFS_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| {
            let level = if quiet { "warn" } else { "info" };
            EnvFilter::new(format!("{level},fuser::session=error,fuser::mnt=error"))
        })
}

/// Install the global subscriber for `sink` (`quiet`: warnings and errors only,
/// for a daemon's terminal). A subscriber that is already installed (e.g. by a
/// test harness) is kept.
pub fn init(sink: &LogSink, quiet: bool) -> Result<()> {
    let registry = tracing_subscriber::registry().with(filter(quiet));
    let fmt = tracing_subscriber::fmt::layer();
    let r = match sink {
        LogSink::File(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("log file {}", p.display()))?;
            registry
                .with(fmt.with_ansi(false).with_writer(Mutex::new(f)))
                .try_init()
        }
        LogSink::Stderr => registry
            .with(
                fmt.with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        LogSink::Journald => {
            let layer = tracing_journald::layer()
                .context("connecting to the systemd journal")?
                .with_syslog_identifier("commitfs".into());
            registry.with(layer).try_init()
        }
        LogSink::Syslog(path) => {
            let w = SyslogWriter::connect(path)?;
            // Syslog stamps the time and the process itself.
            registry
                .with(
                    fmt.with_ansi(false)
                        .without_time()
                        .with_target(false)
                        .with_writer(w),
                )
                .try_init()
        }
    };
    drop(r);
    Ok(())
}

type Logger = syslog::Logger<syslog::LoggerBackend, syslog::Formatter3164>;

/// A `MakeWriter` that sends each formatted event as one syslog message with the
/// event's severity.
#[derive(Clone)]
pub struct SyslogWriter {
    logger: Arc<Mutex<Logger>>,
}

impl SyslogWriter {
    pub fn connect(path: &Path) -> Result<SyslogWriter> {
        let formatter = syslog::Formatter3164 {
            facility: syslog::Facility::LOG_DAEMON,
            hostname: None,
            process: "commitfs".into(),
            pid: std::process::id(),
        };
        let logger = syslog::unix_custom(formatter, path)
            .map_err(|e| anyhow::anyhow!("syslog socket {}: {e}", path.display()))?;
        Ok(SyslogWriter {
            logger: Arc::new(Mutex::new(logger)),
        })
    }
}

/// One event being formatted; sent when dropped.
pub struct SyslogEvent {
    logger: Arc<Mutex<Logger>>,
    level: Level,
    buf: Vec<u8>,
}

impl Write for SyslogEvent {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for SyslogEvent {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buf);
        let msg = text.trim_end();
        if msg.is_empty() {
            return;
        }
        let Ok(mut l) = self.logger.lock() else {
            return;
        };
        // A lost log line must not take the file system down.
        let _ = match self.level {
            Level::ERROR => l.err(msg),
            Level::WARN => l.warning(msg),
            Level::INFO => l.info(msg),
            _ => l.debug(msg),
        };
    }
}

impl<'a> MakeWriter<'a> for SyslogWriter {
    type Writer = SyslogEvent;

    fn make_writer(&'a self) -> SyslogEvent {
        SyslogEvent {
            logger: self.logger.clone(),
            level: Level::INFO,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> SyslogEvent {
        SyslogEvent {
            logger: self.logger.clone(),
            level: *meta.level(),
            buf: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinks() {
        assert_eq!(
            LogSink::for_daemon(Some(Path::new("/x.log"))),
            LogSink::File("/x.log".into())
        );
        assert_eq!(LogSink::for_foreground(None), LogSink::Stderr);
    }
}
