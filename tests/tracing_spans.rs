//! One root span per delivery (message id, type, attempt) and a child span per handler.

#[path = "support/messages.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dacapo::prelude::*;
use dacapo::testing::{Fault, Recorder, TestHarness};
use support::{MemberRemoved, member_removed};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Debug, Default)]
struct SpanData {
    name: String,
    parent: Option<u64>,
    fields: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<HashMap<u64, SpanData>>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut data = SpanData {
            name: attrs.metadata().name().to_owned(),
            parent: ctx
                .span_scope(id)
                .and_then(|mut s| s.nth(1))
                .map(|p| p.id().into_u64()),
            ..SpanData::default()
        };
        if let Some(parent) = attrs.parent() {
            data.parent = Some(parent.into_u64());
        } else if attrs.is_root() {
            data.parent = None;
        }
        attrs.record(&mut Fields(&mut data.fields));
        self.0.lock().unwrap().insert(id.into_u64(), data);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(data) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut data.fields));
        }
    }
}

#[tokio::test]
async fn each_delivery_has_a_root_span_and_each_handler_a_child_span() {
    let capture = Capture::default();
    // The engine runs on its own threads, so the subscriber must be global; this file holds
    // this one test so that nothing else installs one.
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .unwrap();

    let harness = TestHarness::builder()
        .module(
            Module::new("workspaces").handle_named::<MemberRemoved, _>("revoke", Recorder::new()),
        )
        .module(Module::new("webhooks").handle_named::<MemberRemoved, _>("queue", Recorder::new()))
        .fault("webhooks", "queue", Fault::fail_times(1))
        .build()
        .unwrap();
    let report = harness.publish(&member_removed()).await.unwrap();
    assert_eq!(report.attempts, 2);

    let spans = capture.0.lock().unwrap().clone();
    let id = report.envelope_id.to_string();
    let roots: Vec<(&u64, &SpanData)> = spans
        .iter()
        .filter(|(_, s)| {
            s.name == "dacapo.delivery" && s.fields.get("messaging.message.id") == Some(&id)
        })
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "one root span for the delivery, across its attempts"
    );
    let (root_id, root) = roots[0];
    assert_eq!(root.parent, None);
    assert_eq!(
        root.fields["dacapo.message_type"],
        "organization.member_removed"
    );
    assert_eq!(
        root.fields["dacapo.attempt"], "2",
        "the root span records the current attempt"
    );

    let mut handlers: Vec<(String, String, String)> = spans
        .values()
        .filter(|s| s.name == "dacapo.handler" && s.parent == Some(*root_id))
        .map(|s| {
            (
                s.fields["dacapo.module"].clone(),
                s.fields["dacapo.handler"].clone(),
                s.fields["dacapo.attempt"].clone(),
            )
        })
        .collect();
    handlers.sort();
    assert_eq!(
        handlers,
        [
            ("webhooks".into(), "queue".into(), "1".into()),
            ("webhooks".into(), "queue".into(), "2".into()),
            ("workspaces".into(), "revoke".into(), "1".into()),
            ("workspaces".into(), "revoke".into(), "2".into()),
        ]
    );
}
