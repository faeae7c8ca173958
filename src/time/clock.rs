//! Processing time, passed in: what kestrel stamps on the rows it writes (`updated_at`,
//! `detected_at`, `_ingested_at`, plan and run-log times). The system clock by default;
//! a test sets it to make those columns exact. Event time never comes from here (it is
//! data), and neither do lease expiries and file ages, which must agree across
//! processes and so stay on the wall clock.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::Micros;

/// The system clock, a set one, or the system clock shifted by a set offset; a set
/// clock's clones follow it.
#[derive(Debug, Clone, Default)]
pub struct Clock(Option<Arc<Set>>);

#[derive(Debug)]
struct Set {
    /// The time (fixed) or the offset from the system clock (shifted).
    value: AtomicI64,
    shifted: bool,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Self {
        Clock(None)
    }

    /// A clock standing at `us` until [`Clock::set`] moves it.
    pub fn fixed(us: Micros) -> Self {
        Clock(Some(Arc::new(Set {
            value: AtomicI64::new(us),
            shifted: false,
        })))
    }

    /// A clock that runs as the system clock does, from `us` now; [`Clock::set`] puts
    /// it at another time, from which it runs on. A simulation of days in minutes (the
    /// `age` benchmark) stamps what it writes with the simulated time this way, while
    /// durations measured on it stay real.
    pub fn shifted(us: Micros) -> Self {
        Clock(Some(Arc::new(Set {
            value: AtomicI64::new(us - Utc::now().timestamp_micros()),
            shifted: true,
        })))
    }

    /// Move a set clock (and its clones) to `us`; the system clock ignores it.
    pub fn set(&self, us: Micros) {
        if let Some(t) = &self.0 {
            let v = match t.shifted {
                true => us - Utc::now().timestamp_micros(),
                false => us,
            };
            t.value.store(v, Ordering::SeqCst);
        }
    }

    /// Now, in microseconds since the epoch (UTC).
    pub fn now_us(&self) -> Micros {
        match &self.0 {
            Some(t) if t.shifted => Utc::now().timestamp_micros() + t.value.load(Ordering::SeqCst),
            Some(t) => t.value.load(Ordering::SeqCst),
            None => Utc::now().timestamp_micros(),
        }
    }

    /// Now, as a date-time.
    pub fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_micros(self.now_us()).unwrap_or_default()
    }
}

/// CPU time (user + system) this process has used so far, in microseconds: a batch's
/// cost is the difference across it (in a process doing one thing at a time, as `run`
/// does, that is the batch's own).
pub fn cpu_us() -> Micros {
    // SAFETY: getrusage writes only into the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    let tv = |t: libc::timeval| t.tv_sec * 1_000_000 + t.tv_usec;
    tv(u.ru_utime) + tv(u.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_clock_stays_until_set_and_clones_follow() {
        let c = Clock::fixed(1_000_000);
        let d = c.clone();
        assert_eq!(c.now_us(), 1_000_000);
        d.set(2_000_000);
        assert_eq!(c.now_us(), 2_000_000);
        assert_eq!(c.now().to_rfc3339(), "1970-01-01T00:00:02+00:00");
        let s = Clock::system();
        s.set(5);
        assert!(s.now_us() > 1_700_000_000_000_000);
    }

    #[test]
    fn a_shifted_clock_runs_from_where_it_is_set() {
        let day = 86_400_000_000;
        let c = Clock::shifted(day);
        let twin = c.clone();
        let a = twin.now_us();
        assert!((day..day + 60_000_000).contains(&a), "{a}");
        c.set(10 * day);
        let b = twin.now_us();
        assert!((10 * day..10 * day + 60_000_000).contains(&b), "{b}");
        assert!(twin.now_us() >= b, "it runs on");
    }
}
