//! Durations in reasons and errors as an operator reads them: milliseconds ("184 ms"), not
//! `Duration`'s Debug ("183.669025ms", "1.5s", "250µs").

#![forbid(unsafe_code)]

use std::fmt;
use std::time::Duration;

/// Displays a duration in milliseconds: whole ones from 1 ms up, three decimals below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Millis(pub Duration);

impl Millis {
    /// For a borrowed duration (an error's field).
    pub fn of(d: &Duration) -> Self {
        Millis(*d)
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_secs_f64() * 1000.0;
        if ms >= 1.0 || ms == 0.0 {
            write!(f, "{ms:.0} ms")
        } else {
            write!(f, "{ms:.3} ms")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_milliseconds() {
        let show = |d| Millis(d).to_string();
        assert_eq!(show(Duration::from_nanos(183_669_025)), "184 ms");
        assert_eq!(show(Duration::from_secs(30)), "30000 ms");
        assert_eq!(show(Duration::from_micros(250)), "0.250 ms");
        assert_eq!(show(Duration::ZERO), "0 ms");
    }
}
