//! Every warning (and error) logged anywhere in a test binary, through one global subscriber (the engine
//! logs on its own threads, which a thread-local subscriber would not see).
#![allow(dead_code, unreachable_pub)]

use std::sync::{Mutex, OnceLock};

/// Every warning or error logged anywhere in this test binary (the engine logs on its own
/// threads).
pub fn warnings() -> &'static Mutex<Vec<String>> {
    static WARNINGS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    WARNINGS.get_or_init(|| {
        struct Capture;
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
            fn on_event(
                &self,
                event: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                // Errors too: more severe than a warning, they are never left out.
                if *event.metadata().level() > tracing::Level::WARN {
                    return;
                }
                struct Text(String);
                impl tracing::field::Visit for Text {
                    fn record_debug(
                        &mut self,
                        field: &tracing::field::Field,
                        value: &dyn std::fmt::Debug,
                    ) {
                        self.0.push_str(&format!("{}={value:?} ", field.name()));
                    }
                }
                let mut text = Text(String::new());
                event.record(&mut text);
                warnings().lock().unwrap().push(text.0);
            }
        }
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture))
            .expect("this binary installs the only global subscriber");
        Mutex::new(Vec::new())
    })
}
