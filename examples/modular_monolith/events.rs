//! The integration events the modules exchange.

use dacapo::prelude::*;
use serde::{Deserialize, Serialize};

/// Published by organizations when a member leaves.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct MemberRemoved {
    pub(crate) organization_id: i64,
    pub(crate) member_id: i64,
}

impl Message for MemberRemoved {
    const TYPE: &'static str = "organization.member_removed";
}

/// Cascaded by webhooks for each newly queued delivery.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct WebhookDeliveryRequested {
    pub(crate) delivery_id: String,
}

impl Message for WebhookDeliveryRequested {
    const TYPE: &'static str = "webhooks.delivery_requested";
}
