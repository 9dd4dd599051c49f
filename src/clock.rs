//! The proxy's clock: the only source of the time that lease deadlines, the
//! settle window, the handover barrier and the restart window are measured
//! on. (I/O deadlines, such as the header read timeout or the upstream
//! deadline, are tokio timers; the client commands measure latency with
//! [`Stopwatch`].) `.clippy.toml` bans reading std's and tokio's clocks
//! anywhere else in the workspace, but for the benchmarks (they measure
//! wall time), one function in the `fencegate-client` crate (its guard's
//! deadlines, on tokio's monotonic clock plus the time suspended, as this
//! clock counts it) and the time budget of the simulator's test and
//! example.
//!
//! Lease deadlines live on a monotonic millisecond timeline that starts when the
//! process starts. Wall time is never used for deadlines, so a clock step (NTP,
//! a VM resume, an operator) cannot shorten or lengthen a live term. It is read
//! only for a hint the journal keeps with each grant and renewal
//! ([`Clock::wall_ms`]), by which a restart may end a recovered term early,
//! never extend one.
//!
//! Two clocks share one handle, [`Clock`]:
//! - the system clock reads tokio's monotonic [`tokio::time::Instant`] (so tests
//!   that pause tokio's time also pause it), plus the time the machine spent
//!   suspended since the clock started: on Linux `CLOCK_MONOTONIC`, which
//!   tokio reads, stops during a system suspend, and `CLOCK_BOOTTIME` does
//!   not; the clock adds how far the two drifted apart, so a term or a
//!   primary's deadline that passed while the machine slept has passed when
//!   it wakes (a primary suspended past its etcd lease does not wake
//!   believing it is still primary). tokio's timers still run on the
//!   monotonic clock: a waiter asleep across a suspend wakes that much late,
//!   and then sees the right time;
//! - the manual clock only moves when [`Clock::advance`] is called, which is how
//!   tests and `--clock manual` replay a timeline exactly.

// The one module allowed to read the clocks `.clippy.toml` bans elsewhere.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Which kind of clock a [`Clock`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ClockKind {
    /// Monotonic time since process start.
    #[default]
    System,
    /// Time that only moves when told to (tests, demos, `POST /_fence/clock`).
    Manual,
}

impl std::str::FromStr for ClockKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "system" => Ok(Self::System),
            "manual" => Ok(Self::Manual),
            other => Err(format!(
                "unknown clock {other:?} (expected system or manual)"
            )),
        }
    }
}

/// Where a manual clock's wall clock stands at its time 0 (2020-09-13).
pub const MANUAL_WALL_EPOCH_MS: u64 = 1_600_000_000_000;

/// A cheap, cloneable handle to the proxy's monotonic millisecond clock.
#[derive(Clone, Debug)]
pub struct Clock {
    inner: Arc<Inner>,
}

#[derive(Debug)]
enum Inner {
    System { origin: Instant, suspend: Suspend },
    Manual { now_ms: AtomicU64, advanced: Notify },
}

/// How long the machine was suspended since the clock started: how much
/// further `CLOCK_BOOTTIME` went than `CLOCK_MONOTONIC`.
#[derive(Debug)]
struct Suspend {
    /// `CLOCK_BOOTTIME - CLOCK_MONOTONIC` when the clock started, in ns.
    start_ns: u64,
    /// The suspended time seen so far, in ms: it only grows, and only by a
    /// whole step of at least 2 ms, so the nanoseconds between the two
    /// readings never make the clock go back.
    seen_ms: AtomicU64,
    /// Where the offset comes from (a fake one in tests).
    offset_ns: fn() -> u64,
}

impl Suspend {
    fn new(offset_ns: fn() -> u64) -> Self {
        Self {
            start_ns: offset_ns(),
            seen_ms: AtomicU64::new(0),
            offset_ns,
        }
    }

    fn ms(&self) -> u64 {
        let now = (self.offset_ns)().saturating_sub(self.start_ns) / 1_000_000;
        let seen = self.seen_ms.load(Ordering::Relaxed);
        if now >= seen.saturating_add(2) {
            self.seen_ms.fetch_max(now, Ordering::Relaxed);
            now
        } else {
            seen
        }
    }
}

/// `CLOCK_BOOTTIME - CLOCK_MONOTONIC` in nanoseconds: the time the machine
/// has spent suspended since it booted (0 where there is no such clock).
fn boot_minus_monotonic_ns() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let read = |id| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime only writes the timespec it is given, a
            // local; both clocks exist on every Linux fencegate runs on.
            #[allow(unsafe_code)]
            let ok = unsafe { libc::clock_gettime(id, &mut ts) } == 0;
            (ok).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
        };
        match (read(libc::CLOCK_BOOTTIME), read(libc::CLOCK_MONOTONIC)) {
            (Some(boot), Some(mono)) => boot.saturating_sub(mono),
            _ => 0,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

impl Clock {
    /// The monotonic system clock, starting at 0 now.
    pub fn system() -> Self {
        Self {
            inner: Arc::new(Inner::System {
                origin: Instant::now(),
                suspend: Suspend::new(boot_minus_monotonic_ns),
            }),
        }
    }

    /// A manual clock starting at `start_ms`.
    pub fn manual(start_ms: u64) -> Self {
        Self {
            inner: Arc::new(Inner::Manual {
                now_ms: AtomicU64::new(start_ms),
                advanced: Notify::new(),
            }),
        }
    }

    /// A clock of the given kind.
    pub fn new(kind: ClockKind) -> Self {
        match kind {
            ClockKind::System => Self::system(),
            ClockKind::Manual => Self::manual(0),
        }
    }

    /// Which kind of clock this is.
    pub fn kind(&self) -> ClockKind {
        match &*self.inner {
            Inner::System { .. } => ClockKind::System,
            Inner::Manual { .. } => ClockKind::Manual,
        }
    }

    /// Milliseconds since the clock's origin. Never goes backwards.
    pub fn now_ms(&self) -> u64 {
        match &*self.inner {
            Inner::System { origin, suspend } => {
                let awake = u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
                awake.saturating_add(suspend.ms())
            }
            Inner::Manual { now_ms, .. } => now_ms.load(Ordering::Acquire),
        }
    }

    /// How long the machine was suspended since the clock started, as far
    /// as the clock has counted it (0 for a manual clock).
    pub fn suspended_ms(&self) -> u64 {
        match &*self.inner {
            Inner::System { suspend, .. } => suspend.ms(),
            Inner::Manual { .. } => 0,
        }
    }

    /// The wall clock, in ms since the Unix epoch (0 if it reads before the
    /// epoch): a hint for the journal, never a deadline. A manual clock's
    /// wall clock is its own time above [`MANUAL_WALL_EPOCH_MS`].
    pub fn wall_ms(&self) -> u64 {
        match &*self.inner {
            Inner::System { .. } => unix_now_ms(),
            Inner::Manual { now_ms, .. } => {
                MANUAL_WALL_EPOCH_MS.saturating_add(now_ms.load(Ordering::Acquire))
            }
        }
    }

    /// Moves a manual clock forward by `ms` and returns the new time; `None` for
    /// the system clock, which cannot be moved.
    pub fn advance(&self, ms: u64) -> Option<u64> {
        match &*self.inner {
            Inner::System { .. } => None,
            Inner::Manual { now_ms, advanced } => {
                // fetch_update keeps the clock saturating instead of wrapping.
                let prev = now_ms
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                        Some(t.saturating_add(ms))
                    })
                    .unwrap_or_else(|t| t);
                advanced.notify_waiters();
                Some(prev.saturating_add(ms))
            }
        }
    }

    /// Completes once `now_ms() >= deadline_ms`.
    pub async fn sleep_until(&self, deadline_ms: u64) {
        match &*self.inner {
            Inner::System { origin, suspend } => {
                // On tokio's (monotonic) timeline, less the time slept.
                let awake_ms = deadline_ms.saturating_sub(suspend.ms());
                let at = origin
                    .checked_add(std::time::Duration::from_millis(awake_ms))
                    .unwrap_or_else(|| {
                        Instant::now() + std::time::Duration::from_secs(86_400 * 365)
                    });
                tokio::time::sleep_until(at).await;
            }
            Inner::Manual { now_ms, advanced } => loop {
                // Register interest before checking, so an advance between the
                // check and the await is not missed.
                let notified = advanced.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if now_ms.load(Ordering::Acquire) >= deadline_ms {
                    return;
                }
                notified.await;
            },
        }
    }
}

/// The system's wall clock, in ms since the Unix epoch (0 if it reads
/// before the epoch): for hints and signatures (S3's), never a deadline.
pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A monotonic stopwatch with microsecond resolution, for measuring latency
/// and setting I/O deadlines (leases are measured on [`Clock`]).
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch(Instant);

impl Stopwatch {
    /// Starts now.
    pub fn start() -> Self {
        Self(Instant::now())
    }

    /// Microseconds since the start.
    pub fn elapsed_us(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The tokio instant it started at.
    pub fn started(&self) -> Instant {
        self.0
    }

    /// Milliseconds since the start.
    pub fn elapsed_ms(&self) -> u64 {
        self.elapsed_us() / 1000
    }

    /// The tokio instant `ms` milliseconds after the start: an I/O deadline
    /// (for `tokio::time::timeout_at`).
    pub fn deadline_after_ms(&self, ms: u64) -> Instant {
        let after = std::time::Duration::from_millis(ms);
        // Past what the platform's instants hold: a year, as never.
        self.0
            .checked_add(after)
            .unwrap_or_else(|| self.0 + std::time::Duration::from_secs(86_400 * 365))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = Clock::manual(5);
        assert_eq!(clock.now_ms(), 5);
        assert_eq!(clock.advance(10), Some(15));
        assert_eq!(clock.now_ms(), 15);
        assert_eq!(clock.advance(u64::MAX), Some(u64::MAX));
        assert_eq!(clock.now_ms(), u64::MAX);
    }

    #[test]
    fn system_clock_cannot_be_advanced() {
        assert_eq!(Clock::system().advance(1), None);
    }

    #[tokio::test]
    async fn manual_sleep_wakes_on_advance() {
        let clock = Clock::manual(0);
        let waiter = tokio::spawn({
            let clock = clock.clone();
            async move { clock.sleep_until(100).await }
        });
        tokio::task::yield_now().await;
        clock.advance(50);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        clock.advance(50);
        waiter.await.unwrap();
    }

    /// The time the machine spent suspended counts (a real suspend cannot
    /// be had in a test: the offset is faked), never going back for the
    /// nanoseconds between the two clocks' readings.
    #[tokio::test(start_paused = true)]
    async fn the_system_clock_counts_a_suspend() {
        static OFFSET_NS: AtomicU64 = AtomicU64::new(5_000_000_000);
        fn fake() -> u64 {
            OFFSET_NS.load(Ordering::Relaxed)
        }
        let clock = Clock {
            inner: Arc::new(Inner::System {
                origin: Instant::now(),
                suspend: Suspend::new(fake),
            }),
        };
        let t0 = clock.now_ms();
        tokio::time::advance(std::time::Duration::from_millis(100)).await;
        assert_eq!(clock.now_ms() - t0, 100);
        // Suspended for 30 s: the monotonic clock stood still.
        OFFSET_NS.fetch_add(30_000_000_000, Ordering::Relaxed);
        assert_eq!(clock.now_ms() - t0, 30_100);
        // Readings a nanosecond apart around a millisecond boundary.
        OFFSET_NS.fetch_sub(1_000_001, Ordering::Relaxed);
        assert_eq!(clock.now_ms() - t0, 30_100);
    }

    #[tokio::test(start_paused = true)]
    async fn system_clock_follows_paused_tokio_time() {
        let clock = Clock::system();
        let t0 = clock.now_ms();
        tokio::time::advance(std::time::Duration::from_millis(1500)).await;
        assert_eq!(clock.now_ms() - t0, 1500);
    }
}
