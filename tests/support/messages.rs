//! Messages and handlers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dacapo::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberRemoved {
    pub organization_id: u64,
    pub member_id: u64,
}

impl Message for MemberRemoved {
    const TYPE: &'static str = "organization.member_removed";
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WebhookQueued {
    pub delivery_id: String,
}

impl Message for WebhookQueued {
    const TYPE: &'static str = "webhooks.delivery_queued";
}

pub fn member_removed() -> MemberRemoved {
    MemberRemoved {
        organization_id: 1,
        member_id: 7,
    }
}

/// Counts its calls and succeeds.
#[derive(Clone, Default)]
pub struct Counter(pub Arc<AtomicUsize>);

impl Counter {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl<M: Message> Handler<M> for Counter {
    async fn handle(&self, _: &M, _: &MessageContext) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Whole seconds, for comparing cooldowns.
pub fn secs(list: &[u64]) -> Vec<std::time::Duration> {
    list.iter()
        .map(|s| std::time::Duration::from_secs(*s))
        .collect()
}

/// Publishes `count` removals through `runtime`, and waits, at most 5 s, until each failed
/// and scheduled its retry: their slots are held by deliveries cooling down.
pub async fn publish_until_cooling(runtime: &Runtime, count: u64) {
    let before = runtime.stats().retried;
    for _ in 0..count {
        runtime.publish(&member_removed()).await.unwrap();
    }
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while runtime.stats().retried < before + count {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the deliveries cool down");
}
