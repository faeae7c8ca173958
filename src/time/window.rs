//! Window assignment: tumbling and sliding windows aligned to the Unix epoch (UTC), and
//! session windows per key. Windows are `[start, end)`.

use std::time::Duration;

use super::{micros, Micros};

/// A window specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSpec {
    /// Fixed, non-overlapping windows of `size`.
    Tumbling { size: Micros },
    /// Windows of `size` starting every `slide`; each event is in `size / slide` windows.
    Sliding { size: Micros, slide: Micros },
    /// Per key: a gap of at least `gap` between consecutive events starts a new session.
    Session { gap: Micros },
}

impl WindowSpec {
    /// Tumbling windows; `size` must be positive.
    pub fn tumbling(size: Duration) -> Result<Self, String> {
        let size = micros(size);
        if size <= 0 {
            return Err("window size must be positive".into());
        }
        Ok(WindowSpec::Tumbling { size })
    }

    /// Sliding windows; `slide` must be positive and divide `size`.
    pub fn sliding(size: Duration, slide: Duration) -> Result<Self, String> {
        let (size, slide) = (micros(size), micros(slide));
        if size <= 0 || slide <= 0 {
            return Err("window size and slide must be positive".into());
        }
        if size % slide != 0 {
            return Err(format!(
                "a slide that divides the size (got slide {}s, size {}s)",
                slide as f64 / 1e6,
                size as f64 / 1e6
            ));
        }
        Ok(WindowSpec::Sliding { size, slide })
    }

    /// Session windows; `gap` must be positive.
    pub fn session(gap: Duration) -> Result<Self, String> {
        let gap = micros(gap);
        if gap <= 0 {
            return Err("session gap must be positive".into());
        }
        Ok(WindowSpec::Session { gap })
    }

    /// Call `f(start, end)` for each window holding an event at `ts`, earliest first
    /// (tumbling and sliding; none for sessions). Allocation-free [`Self::windows_for`].
    #[inline]
    pub fn each_window(&self, ts: Micros, mut f: impl FnMut(Micros, Micros)) {
        match *self {
            WindowSpec::Tumbling { size } => {
                let start = ts.div_euclid(size) * size;
                f(start, start + size)
            }
            WindowSpec::Sliding { size, slide } => {
                let last = ts.div_euclid(slide) * slide;
                for k in (0..size / slide).rev() {
                    let start = last - k * slide;
                    f(start, start + size)
                }
            }
            WindowSpec::Session { .. } => {}
        }
    }

    /// The `[start, end)` windows holding an event at `ts`, earliest first (tumbling and
    /// sliding; empty for sessions, which depend on neighbouring events).
    pub fn windows_for(&self, ts: Micros) -> Vec<(Micros, Micros)> {
        let mut out = Vec::new();
        self.each_window(ts, |start, end| out.push((start, end)));
        out
    }
}

/// One session of a key: first and last event time and the number of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    pub start: Micros,
    pub end: Micros,
    pub events: usize,
}

/// Split event times (any order) into sessions: sorted, a gap `>= gap` starts a new one.
pub fn sessions(ts: &[Micros], gap: Micros) -> Vec<Session> {
    let mut sorted = ts.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<Session> = Vec::new();
    for t in sorted {
        match out.last_mut() {
            Some(s) if t - s.end < gap => {
                s.end = t;
                s.events += 1;
            }
            _ => out.push(Session {
                start: t,
                end: t,
                events: 1,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Micros = 60_000_000;

    #[test]
    fn tumbling_is_epoch_aligned() {
        let w = WindowSpec::tumbling(Duration::from_secs(300)).unwrap();
        assert_eq!(w.windows_for(7 * M + 1), vec![(5 * M, 10 * M)]);
        assert_eq!(w.windows_for(10 * M), vec![(10 * M, 15 * M)]);
        // before the epoch too
        assert_eq!(w.windows_for(-1), vec![(-5 * M, 0)]);
    }

    #[test]
    fn sliding_puts_each_event_in_size_over_slide_windows() {
        let w = WindowSpec::sliding(Duration::from_secs(3600), Duration::from_secs(300)).unwrap();
        let ws = w.windows_for(62 * M);
        assert_eq!(ws.len(), 12);
        assert_eq!(ws[0], (5 * M, 65 * M));
        assert_eq!(ws[11], (60 * M, 120 * M));
        assert!(ws.iter().all(|(s, e)| *s <= 62 * M && 62 * M < *e));
        assert!(
            WindowSpec::sliding(Duration::from_secs(3600), Duration::from_secs(7 * 60)).is_err()
        );
    }

    #[test]
    fn sessions_split_on_gaps_of_at_least_the_gap() {
        let gap = 30 * M;
        let s = sessions(&[40 * M, 0, 10 * M, 70 * M, 100 * M], gap);
        assert_eq!(
            s,
            vec![
                Session {
                    start: 0,
                    end: 10 * M,
                    events: 2
                },
                Session {
                    start: 40 * M,
                    end: 40 * M,
                    events: 1
                },
                Session {
                    start: 70 * M,
                    end: 70 * M,
                    events: 1
                },
                Session {
                    start: 100 * M,
                    end: 100 * M,
                    events: 1
                },
            ]
        );
        // a late event in the gap merges two sessions
        let merged = sessions(&[0, 10 * M, 40 * M, 25 * M], gap);
        assert_eq!(
            merged,
            vec![Session {
                start: 0,
                end: 40 * M,
                events: 4
            }]
        );
    }
}
