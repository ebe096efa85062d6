//! A counter that tests can wait on: each change wakes whoever waits for a value, so a test
//! waits for the event itself (a job reaching the model, a request opening upstream) instead of
//! polling on a timer.

use std::time::Duration;
use tokio::sync::watch;

pub struct Count(watch::Sender<i64>);

impl Default for Count {
    fn default() -> Self {
        Count(watch::Sender::new(0))
    }
}

impl Count {
    pub fn get(&self) -> i64 {
        *self.0.borrow()
    }

    /// Adds `n` and returns the new value.
    pub fn add(&self, n: i64) -> i64 {
        let mut now = 0;
        self.0.send_modify(|v| {
            *v += n;
            now = *v;
        });
        now
    }

    /// Raises it to `n` when `n` is more.
    pub fn max(&self, n: i64) {
        self.0.send_if_modified(|v| {
            let raise = n > *v;
            if raise {
                *v = n;
            }
            raise
        });
    }

    /// Waits until `holds` is true of the value, up to `within`; whether it came true.
    pub async fn until(&self, within: Duration, holds: impl FnMut(&i64) -> bool) -> bool {
        let mut rx = self.0.subscribe();
        tokio::time::timeout(within, rx.wait_for(holds))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until it reaches `n`, panicking after `within` with `what` and the value.
    pub async fn reach(&self, n: i64, within: Duration, what: &str) {
        if !self.until(within, |v| *v >= n).await {
            panic!("{what}: {} after {within:?}, waited for {n}", self.get());
        }
    }
}
