//! OpenTelemetry: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the controller and the hosts export
//! their spans over OTLP/gRPC. A small trace receiver (a tonic server of the OTLP trace service)
//! on 127.0.0.1 receives the hosts' `instruction` spans (job, step, actor, device, instruction,
//! micro-batch, bytes) and the controller's `step` spans (job, step, loss).

mod common;

mod otlp_text;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tonic::{Request, Response, Status};

use otlp_text::{service_name, text};

use archipelago_controller::TrainOptions;
use common::{Cluster, plan, program};

/// A received span: its service, name and attributes (printed).
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    attributes: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = service_name(resource.resource.iter().flat_map(|r| &r.attributes));
            for scope in resource.scope_spans {
                for span in scope.spans {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                        .collect();
                    spans.push(Received {
                        service: service.clone(),
                        name: span.name.clone(),
                        attributes,
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[test]
fn controller_and_hosts_export_their_spans_over_otlp() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = Receiver::default();
    let addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
        addr
    });
    let endpoint = format!("http://{addr}");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut cluster = Cluster::start_with(5.0, 30.0, &env);
    cluster.add_host("h1", "cpu:0");
    cluster.add_host("h2", "cpu:0");
    let options = TrainOptions {
        steps: 3,
        job: "otlp".into(),
        ..TrainOptions::default()
    };
    cluster
        .controller()
        .train(&program(plan(2, 1, 0)), &options)
        .unwrap();

    let find = |service: &str, name: &str| {
        receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .find(|s| {
                s.service == service && s.name == name && s.attributes.get("step") == Some(&"3".to_string())
            })
            .cloned()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while (find("archipelago-host", "instruction").is_none()
        || find("archipelago-controller", "step").is_none())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let instruction =
        find("archipelago-host", "instruction").expect("no instruction span of step 3 from a host");
    for key in [
        "job",
        "step",
        "actor",
        "device",
        "index",
        "instruction",
        "mb",
        "bytes",
    ] {
        assert!(
            instruction.attributes.contains_key(key),
            "instruction span lacks `{key}`: {instruction:?}"
        );
    }
    assert_eq!(instruction.attributes["job"], "otlp");
    assert_eq!(instruction.attributes["device"], "cpu:0");
    let spans = receiver.spans.lock().unwrap().clone();
    let moved = spans.iter().any(|s| {
        s.name == "instruction"
            && s.attributes
                .get("instruction")
                .is_some_and(|i| i.starts_with("AllReduceSum"))
            && s.attributes.get("bytes").and_then(|b| b.parse::<u64>().ok()) > Some(0)
    });
    assert!(moved, "no collective span with the bytes it moved");
    let actors: std::collections::BTreeSet<&String> = spans
        .iter()
        .filter(|s| s.name == "instruction")
        .filter_map(|s| s.attributes.get("actor"))
        .collect();
    assert_eq!(actors.len(), 2, "spans from both hosts' actors: {actors:?}");
    let step = find("archipelago-controller", "step").expect("no step span from the controller");
    assert_eq!(step.attributes["job"], "otlp");
    assert!(step.attributes.contains_key("loss"), "{step:?}");
    assert!(
        !spans
            .iter()
            .any(|s| s.name.starts_with("h2") || s.name.contains("tonic") || s.name.contains("hyper")),
        "transport spans leaked into the export"
    );
}

/// With an endpoint where no collector listens, a job runs and ends as without one (the exporter
/// drops what it cannot send and the flush at exit gives up after its timeout).
#[test]
fn no_collector_blocks_nothing() {
    let began = Instant::now();
    let out = std::process::Command::new(common::BIN)
        .args(["train", "--model", common::MLP, "--steps", "5", "--quiet"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("done: final loss"));
    println!(
        "a 5-step job with an unreachable collector took {:.2} s",
        began.elapsed().as_secs_f64()
    );
}
