//! What the OTLP receiver tests (`otlp.rs`, `otlp_metrics.rs`) share: an attribute's value as
//! text, and a resource's `service.name`.

use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};

/// An attribute's value as text (strings as they are, numbers and booleans printed).
pub fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// The `service.name` among a resource's attributes ("" when absent).
pub fn service_name<'a>(attributes: impl IntoIterator<Item = &'a KeyValue>) -> String {
    (attributes.into_iter())
        .find(|kv| kv.key == "service.name")
        .map(|kv| text(kv.value.as_ref()))
        .unwrap_or_default()
}
