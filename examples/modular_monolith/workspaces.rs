//! The workspaces module: revokes a removed member's access. Here its database is "down" for
//! the first call, which makes the runtime retry the whole delivery, every handler included.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dacapo::prelude::*;

use crate::events::MemberRemoved;

#[derive(Clone)]
pub(crate) struct RevokeAccess {
    calls: Arc<AtomicUsize>,
    failures: Arc<AtomicUsize>,
}

impl RevokeAccess {
    pub(crate) fn failing_once() -> Self {
        Self {
            calls: Arc::default(),
            failures: Arc::default(),
        }
    }

    pub(crate) fn failures(&self) -> usize {
        self.failures.load(Ordering::Relaxed)
    }
}

impl Handler<MemberRemoved> for RevokeAccess {
    async fn handle(&self, _: &MemberRemoved, _: &MessageContext) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::Relaxed) == 0 {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return Err("workspaces database unavailable".into());
        }
        Ok(())
    }
}
