//! Claims that count the store round trips made for them, around real ones.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use dacapo::ports::{Claim, ClaimOutcome, Claims};
use dacapo::store::MemoryClaims;

/// Counts every claim and release, delegating to `inner`.
pub struct CountingClaims {
    calls: AtomicUsize,
    inner: Box<dyn Claims>,
}

impl CountingClaims {
    /// Counting around `inner`.
    pub fn around(inner: Box<dyn Claims>) -> Self {
        Self {
            calls: AtomicUsize::new(0),
            inner,
        }
    }

    /// Claims and releases so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Default for CountingClaims {
    fn default() -> Self {
        Self::around(Box::new(MemoryClaims::default()))
    }
}

#[async_trait]
impl Claims for CountingClaims {
    async fn provision(&self) -> Result<(), dacapo::EngineError> {
        self.inner.provision().await
    }
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, dacapo::EngineError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(claim).await
    }
    async fn release(&self, claim: &Claim) -> Result<(), dacapo::EngineError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.release(claim).await
    }
    async fn complete(
        &self,
        claim: &Claim,
        cascaded: &[dacapo::Envelope],
    ) -> Result<bool, dacapo::EngineError> {
        self.inner.complete(claim, cascaded).await
    }
}
