//! A wall clock the test moves by hand.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

/// Reads the time it was last set to; starts at the real time.
#[derive(Clone)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl Default for ManualClock {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Utc::now())))
    }
}

impl ManualClock {
    pub fn set(&self, at: DateTime<Utc>) {
        *self.0.lock().unwrap() = at;
    }

    pub fn advance(&self, by: chrono::Duration) {
        *self.0.lock().unwrap() += by;
    }
}

impl dacapo::ports::Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap()
    }
}
