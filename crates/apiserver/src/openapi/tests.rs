//! The generated document against what the servers really do: the routes the router
//! registers, the fields the wire types (de)serialize, the error codes, and the checked-in copy
//! that readers and the Python SDK's test use.

use std::collections::{BTreeMap, BTreeSet};

use dsec_wire::api::*;
use serde::Serialize;
use serde_json::{json, Value};

use super::{document_json, EDGE_PASS_THROUGH};
use crate::routes::{public_routes, v1_routes, Verb};

fn doc() -> Value {
    serde_json::from_str(document_json()).expect("the document is JSON")
}

/// `{*name}` (axum's catch-all) is `{name}` in OpenAPI.
fn openapi_path(axum_path: &str) -> String {
    axum_path.replace("{*", "{")
}

fn operations(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "put", "post", "delete", "patch", "head", "options"].contains(&&**method) {
                ops.insert((method.clone(), path.clone()));
            }
        }
    }
    ops
}

#[test]
fn every_registered_route_is_described_and_nothing_else() {
    let doc = doc();
    let described = operations(&doc);
    let mut expected = BTreeSet::new();
    for (verb, path) in v1_routes().table().iter().chain(public_routes().table()) {
        if *verb == Verb::Any {
            // The edge pass-through: its routes are listed in EDGE_PASS_THROUGH.
            assert_eq!(
                *path, "/v1/sandboxes/{id}/{*rest}",
                "only the edge pass-through is `any`"
            );
            continue;
        }
        expected.insert((verb.as_str().to_string(), openapi_path(path)));
    }
    for method in super::ports::PROXY_METHODS {
        expected.insert((
            method.to_string(),
            openapi_path(crate::ports::PROXY_ROUTES[2]),
        ));
    }
    for (method, path) in crate::compat::e2b::DOCUMENTED {
        expected.insert((method.to_string(), path.to_string()));
    }
    for (method, path) in EDGE_PASS_THROUGH {
        assert!(
            path.starts_with("/v1/sandboxes/{id}/"),
            "{path} is not under the pass-through"
        );
        assert!(
            expected.insert((method.to_string(), path.to_string())),
            "{method} {path} is also a route of its own"
        );
    }
    let missing: Vec<_> = expected.difference(&described).collect();
    assert!(
        missing.is_empty(),
        "routes without a description in the document: {missing:?}"
    );
    let extra: Vec<_> = described.difference(&expected).collect();
    assert!(
        extra.is_empty(),
        "described operations that no route serves: {extra:?}"
    );
}

#[test]
fn every_operation_has_a_summary_an_answer_and_the_error_body() {
    let doc = doc();
    let public: BTreeSet<String> = public_routes()
        .table()
        .iter()
        .map(|(_, p)| p.to_string())
        .collect();
    let mut operation_ids = BTreeSet::new();
    for (method, path) in operations(&doc) {
        let op = &doc["paths"][&path][&method];
        let what = format!("{method} {path}");
        assert!(
            op["summary"].as_str().is_some_and(|s| !s.is_empty()),
            "{what}: no summary"
        );
        let id = op["operationId"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: no operationId"));
        assert!(
            operation_ids.insert(id.to_string()),
            "{what}: operationId {id} used twice"
        );
        let responses = op["responses"]
            .as_object()
            .unwrap_or_else(|| panic!("{what}: no responses"));
        assert!(
            responses
                .keys()
                .any(|s| s.starts_with('1') || s.starts_with('2')),
            "{what}: no success answer"
        );
        if public.contains(&path) {
            assert_eq!(op["security"], json!([{}]), "{what}: is unauthenticated");
            continue;
        }
        assert!(
            op.get("security").is_none(),
            "{what}: must keep the API-key requirement"
        );
        let error = &responses
            .get("default")
            .unwrap_or_else(|| panic!("{what}: no `default` error answer"))["content"]
            ["application/json"]["schema"]["$ref"];
        assert_eq!(
            error, "#/components/schemas/ErrorBody",
            "{what}: error answer"
        );
    }
    assert_eq!(
        doc["security"],
        json!([{"apiKey": []}]),
        "every /v1 route needs the API key"
    );
    let scheme = &doc["components"]["securitySchemes"]["apiKey"];
    assert_eq!(scheme["type"], "http");
    assert_eq!(scheme["scheme"], "bearer");
}

#[test]
fn every_error_code_is_in_the_document() {
    let doc = doc();
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        schemas["ErrorDetail"]["properties"]["code"]["$ref"],
        "#/components/schemas/ErrorCode"
    );
    let listed: BTreeSet<&str> = schemas["ErrorCode"]["enum"]
        .as_array()
        .expect("ErrorCode is an enum")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let known: BTreeSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(listed, known);
    assert_eq!(schemas["ErrorBody"]["required"], json!(["error"]));
}

// ---------------------------------------------------------------------------------------------
// Fields: every schema of the document against what the type really (de)serializes.

/// Schemas that describe no wire type (answers built ad hoc, query enums).
const DOC_ONLY: &[&str] = &[
    "JobOp",
    "ImportFormat",
    "MicrovmTemplate",
    "MicrovmBoots",
    "MicrovmTemplateList",
    "RemovedTemplates",
    "RevokedKey",
    "QueueFull",
    // A bare volume name (a string, no fields to check) or a `VolumeMountSpec` (checked below).
    "VolumeMount",
];

fn ser<T: Serialize>(value: T) -> Value {
    serde_json::to_value(value).expect("serializes")
}

fn some_s() -> Option<String> {
    Some("x".into())
}

fn error_detail() -> ErrorDetail {
    ErrorDetail {
        code: codes::CONFLICT.into(),
        message: "m".into(),
    }
}

fn file_info() -> FileInfo {
    FileInfo {
        path: "/a".into(),
        name: "a".into(),
        kind: FileKind::Symlink,
        size: 1,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: 0,
        link_target: some_s(),
    }
}

fn image_info() -> ImageInfo {
    ImageInfo {
        name: "i:latest".into(),
        layers: vec![],
        size_bytes: 1,
        created_at: "t".into(),
        in_use: 0,
        parent: some_s(),
        source: some_s(),
    }
}

fn command_result() -> CommandResult {
    CommandResult {
        stdout_b64: some_s(),
        stderr_b64: some_s(),
        ..Default::default()
    }
}

/// One or more serialized values of every wire type in the document, every field present
/// (those skipped when empty are filled). Enums give every variant.
fn samples() -> BTreeMap<&'static str, Vec<Value>> {
    let mut s: BTreeMap<&'static str, Vec<Value>> = BTreeMap::new();
    let mut add = |name: &'static str, v: Value| s.entry(name).or_default().push(v);
    for v in [
        Substrate::Container,
        Substrate::Microvm,
        Substrate::Vm,
        Substrate::Function,
    ] {
        add("Substrate", ser(v));
    }
    add("QueueReport", ser(QueueReport::default()));
    add("CreateBatchRequest", ser(CreateBatchRequest::default()));
    for v in [BatchState::Running, BatchState::Done, BatchState::Cancelled] {
        add("BatchState", ser(v));
    }
    add(
        "BatchStatus",
        ser(BatchStatus {
            id: "bt-1".into(),
            state: BatchState::Running,
            count: 1,
            placed: 0,
            queued: 1,
            failed: 0,
            cancelled: 0,
            sandbox_ids: vec![],
            errors: Default::default(),
            last_error: some_s(),
            created_at: "t".into(),
        }),
    );
    add(
        "CreateSandboxRequest",
        ser(CreateSandboxRequest {
            volumes: [("/data".to_string(), VolumeMount::Name("v".into()))].into(),
            ..Default::default()
        }),
    );
    add("CreateVolumeRequest", ser(CreateVolumeRequest::default()));
    add(
        "VolumeInfo",
        ser(VolumeInfo {
            used_by: vec!["sb".into()],
            ..Default::default()
        }),
    );
    add("VolumeList", ser(VolumeList::default()));
    add(
        "VolumeMountSpec",
        ser(VolumeMountSpec {
            name: "v".into(),
            read_only: true,
        }),
    );
    add("QosClass", ser(QosClass::LatencySensitive));
    add("QosClass", ser(QosClass::BestEffort));
    add("TtlAction", ser(TtlAction::Stop));
    add("TtlAction", ser(TtlAction::Pause));
    for v in [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Stopping,
        SandboxState::Stopped,
        SandboxState::Failed,
    ] {
        add("SandboxState", ser(v));
    }
    add(
        "SandboxInfo",
        ser(SandboxInfo {
            end_reason: Some(EndReason::TtlIdle),
            end_detail: some_s(),
            public_ports: vec![8000],
            ..Default::default()
        }),
    );
    for r in EndReason::ALL {
        add("EndReason", ser(r));
    }
    add(
        "SnapshotRequest",
        ser(SnapshotRequest {
            name: some_s(),
            memory: false,
        }),
    );
    let snapshot = SnapshotInfo {
        id: "snapshot/x".into(),
        sandbox: "sb".into(),
        node: "n".into(),
        step: Some(1),
        image: image_info(),
        snapshot_ms: 1.0,
        shared: true,
    };
    add("SnapshotInfo", ser(snapshot.clone()));
    add(
        "ForkRequest",
        ser(ForkRequest {
            n: 2,
            labels: Default::default(),
            snapshot_name: some_s(),
        }),
    );
    let failure = ForkFailure {
        index: 1,
        error: error_detail(),
    };
    add("ForkFailure", ser(failure.clone()));
    add(
        "ForkResult",
        ser(ForkResult {
            snapshot,
            children: vec![],
            failed: vec![failure],
            duration_ms: 1.0,
        }),
    );
    add("PortUrlRequest", ser(PortUrlRequest::default()));
    add(
        "PortUrl",
        ser(PortUrl {
            host: some_s(),
            ..Default::default()
        }),
    );
    add("PauseReport", ser(PauseReport::default()));
    add("LabelSelector", ser(LabelSelector::default()));
    add(
        "JobOpFailure",
        ser(JobOpFailure {
            id: "sb".into(),
            error: error_detail(),
        }),
    );
    add("JobOpResult", ser(JobOpResult::default()));
    add("SandboxList", ser(SandboxList { sandboxes: vec![] }));
    add("RunShellRequest", ser(RunShellRequest::default()));
    add("ExecRequest", ser(ExecRequest::default()));
    add(
        "TrajectoryRecord",
        ser(TrajectoryRecord {
            blobs: [("stdout".to_string(), "d".to_string())].into(),
            files_written: vec![FileDigest::default()],
            ..Default::default()
        }),
    );
    add("FileDigest", ser(FileDigest::default()));
    add("LastStep", ser(LastStep::default()));
    add("CommandResult", ser(command_result()));
    for v in [
        StreamEvent::Stdout {
            data: "d".into(),
            data_b64: some_s(),
        },
        StreamEvent::Stderr {
            data: "d".into(),
            data_b64: some_s(),
        },
        StreamEvent::Exit {
            result: command_result(),
        },
        StreamEvent::Error {
            error: error_detail(),
        },
    ] {
        add("StreamEvent", ser(v));
    }
    for v in [
        FileKind::File,
        FileKind::Dir,
        FileKind::Symlink,
        FileKind::Other,
    ] {
        add("FileKind", ser(v));
    }
    add("FileInfo", ser(file_info()));
    // Process handles (issue 18).
    add("StartProcessRequest", ser(StartProcessRequest::default()));
    add("ProcessInfo", ser(ProcessInfo::default()));
    add("ProcessList", ser(ProcessList::default()));
    add(
        "SignalProcessRequest",
        ser(SignalProcessRequest {
            signal: "SIGTERM".into(),
            group: true,
        }),
    );
    add("ProcessInputRequest", ser(ProcessInputRequest::default()));
    for v in [
        ProcessEvent::Stdout {
            offset: 0,
            data: "d".into(),
            data_b64: some_s(),
        },
        ProcessEvent::Stderr {
            offset: 0,
            data: "d".into(),
            data_b64: some_s(),
        },
        ProcessEvent::Truncated { from: 0, to: 1 },
        ProcessEvent::End {
            offset: 1,
            info: ProcessInfo::default(),
        },
        ProcessEvent::Error {
            error: error_detail(),
        },
    ] {
        add("ProcessEvent", ser(v));
    }
    add("MetricsSample", ser(MetricsSample::default()));
    add(
        "SandboxMetrics",
        ser(SandboxMetrics {
            sandbox_id: "sb".into(),
            interval_s: 2.0,
            samples: vec![MetricsSample::default()],
        }),
    );
    for k in [
        FsEventKind::Ready,
        FsEventKind::Create,
        FsEventKind::Write,
        FsEventKind::Remove,
        FsEventKind::Rename,
        FsEventKind::Chmod,
        FsEventKind::Overflow,
    ] {
        add("FsEventKind", ser(k));
    }
    add(
        "FsEvent",
        ser(FsEvent {
            kind: FsEventKind::Rename,
            path: "/a".into(),
            to: Some("/b".into()),
            is_dir: false,
        }),
    );
    add(
        "FileList",
        ser(FileList {
            path: "/".into(),
            entries: vec![file_info()],
        }),
    );
    add("TtyControl", ser(TtyControl::Resize { rows: 1, cols: 1 }));
    add("TtyControl", ser(TtyControl::Exit { code: 0 }));
    add(
        "ImageLayerInfo",
        ser(ImageLayerInfo {
            digest: "d".into(),
            size_bytes: 0,
            meta_bytes: 0,
            blob_bytes: 0,
            users: 0,
        }),
    );
    add("ImageInfo", ser(image_info()));
    add("PackDiffRequest", ser(PackDiffRequest::default()));
    add(
        "ImageActionRequest",
        ser(ImageActionRequest::Alias { target: "t".into() }),
    );
    add(
        "TtlUpdate",
        ser(TtlUpdate {
            ttl_running_stop: Some(1),
            ttl_total: Some(2),
            ttl_action: Some(TtlAction::Pause),
        }),
    );
    add(
        "ImageActionRequest",
        ser(ImageActionRequest::Fold {
            max_layer_bytes: Some(1),
            into: some_s(),
        }),
    );
    add(
        "ImageActionRequest",
        ser(ImageActionRequest::Pull {
            reference: "r".into(),
            insecure: false,
            username: some_s(),
            password: some_s(),
            ca_pem: some_s(),
        }),
    );
    for v in [
        ImageActionEvent::Manifest {
            digest: "d".into(),
            layers: 1,
            bytes: 1,
        },
        ImageActionEvent::Download {
            layer: 1,
            digest: "d".into(),
            done: 0,
            total: 1,
        },
        ImageActionEvent::Build { layer: 1 },
        ImageActionEvent::Done {
            image: image_info(),
        },
        ImageActionEvent::Error {
            error: error_detail(),
        },
    ] {
        add("ImageActionEvent", ser(v));
    }
    add("ImageList", ser(ImageList { images: vec![] }));
    add(
        "NodeStatus",
        ser(NodeStatus {
            capabilities: Some(NodeCapabilities::default()),
            admission: Some(AdmissionStatus::default()),
            membership: Some(crate::membership::samples::membership()),
            ..Default::default()
        }),
    );
    add("Capability", ser(Capability::default()));
    add("NodeCapabilities", ser(NodeCapabilities::default()));
    add("AdmissionStatus", ser(AdmissionStatus::default()));
    add("NodeList", ser(NodeList { nodes: vec![] }));
    crate::membership::samples::add_samples(&mut add);
    add(
        "ErrorBody",
        ser(ErrorBody {
            error: error_detail(),
        }),
    );
    add("ErrorDetail", ser(error_detail()));
    for c in ErrorCode::ALL {
        add("ErrorCode", ser(c));
    }
    for v in [NetworkMode::None, NetworkMode::Allowlist, NetworkMode::Open] {
        add("NetworkMode", ser(v));
    }
    add("NetworkRule", ser(NetworkRule::default()));
    add("NetworkSpec", ser(NetworkSpec::default()));
    add(
        "DnsGrant",
        ser(DnsGrant {
            name: "n".into(),
            address: "a".into(),
            expires_in_s: 1,
        }),
    );
    add("NetworkStatus", ser(NetworkStatus::default()));
    for v in [
        FunctionStatus::Ok,
        FunctionStatus::RuntimeError,
        FunctionStatus::Timeout,
        FunctionStatus::MemoryExceeded,
        FunctionStatus::OutputExceeded,
        FunctionStatus::CompileError,
        FunctionStatus::SandboxError,
    ] {
        add("FunctionStatus", ser(v));
    }
    for v in [
        Verdict::Accepted,
        Verdict::WrongAnswer,
        Verdict::TimeLimitExceeded,
        Verdict::MemoryLimitExceeded,
        Verdict::RuntimeError,
        Verdict::CompileError,
        Verdict::OutputLimitExceeded,
        Verdict::SandboxError,
    ] {
        add("Verdict", ser(v));
    }
    add("CompareMode", ser(CompareMode::Exact));
    add("CompareMode", ser(CompareMode::Whitespace));
    add("TestCase", ser(TestCase::default()));
    add("FunctionCallRequest", ser(FunctionCallRequest::default()));
    add("RunResult", ser(RunResult::default()));
    add(
        "CaseResult",
        ser(CaseResult {
            verdict: Verdict::Accepted,
            run: RunResult::default(),
        }),
    );
    add("FunctionCallResult", ser(FunctionCallResult::default()));
    add("FunctionBatchRequest", ser(FunctionBatchRequest::default()));
    add(
        "FunctionBatchItem",
        ser(FunctionBatchItem {
            result: None,
            error: None,
        }),
    );
    add("FunctionBatchResult", ser(FunctionBatchResult::default()));
    add("FunctionPoolInfo", ser(FunctionPoolInfo::default()));
    add("FunctionPoolList", ser(FunctionPoolList::default()));
    // The apiserver's own (IAM, cluster) answers and bodies.
    add("Quota", ser(crate::iam::Quota::default()));
    add("Usage", ser(crate::iam::Usage::default()));
    let project = crate::iam::ProjectView {
        name: "p".into(),
        parent: some_s(),
        quota: Default::default(),
        usage: Default::default(),
    };
    add("ProjectView", ser(&project));
    add(
        "ProjectList",
        ser(crate::iam::ProjectList {
            projects: vec![project],
        }),
    );
    add(
        "CreateProjectRequest",
        ser(crate::iam::CreateProjectRequest {
            name: "p".into(),
            parent: some_s(),
            quota: None,
        }),
    );
    add(
        "CreateKeyRequest",
        ser(crate::iam::CreateKeyRequest {
            principal: "p".into(),
            project: some_s(),
            kind: some_s(),
        }),
    );
    add(
        "CreatedKey",
        ser(crate::iam::CreatedKey {
            principal: "p".into(),
            project: "p".into(),
            kind: "user".into(),
            key_id: "k".into(),
            key: "dsk_x".into(),
        }),
    );
    add(
        "ClusterNode",
        ser(crate::iam::http::ClusterNode {
            node: "n".into(),
            url: "u".into(),
            healthy: true,
            sandboxes: 0,
            capacity: 0,
            load: 0.0,
            labels: Default::default(),
            last_error: some_s(),
            last_seen_ms_ago: Some(1),
        }),
    );
    add(
        "ClusterView",
        ser(crate::iam::http::ClusterView {
            nodes: vec![],
            sandboxes: 0,
            capacity: 0,
            healthy_nodes: 0,
            primary_utilisation: 0.0,
            overflow_threshold: 0.0,
            placement: Default::default(),
            created_total: 0,
            quota_refusals_total: 0,
            placement_refusals_total: 0,
            overflow_placements_total: 0,
        }),
    );
    for v in [
        crate::placement::Strategy::PowerOfK,
        crate::placement::Strategy::Random,
        crate::placement::Strategy::LeastLoaded,
    ] {
        add("Strategy", ser(v));
    }
    s
}

/// What a schema accepts: the property sets of its alternatives (an object is one set; a
/// tagged enum one per variant; `allOf`, as `flatten` makes it, the union), or the strings of
/// a string enum.
#[derive(Debug)]
enum Shape {
    Objects(Vec<BTreeSet<String>>),
    Strings(BTreeSet<String>),
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            &doc["components"]["schemas"][name]
        }
        None => schema,
    }
}

fn shape(doc: &Value, schema: &Value) -> Shape {
    let schema = resolve(doc, schema);
    if let Some(values) = schema["enum"].as_array() {
        return Shape::Strings(
            values
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
        );
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(alts) = schema[key].as_array() {
            let mut objects = Vec::new();
            let mut strings = BTreeSet::new();
            for alt in alts {
                match shape(doc, alt) {
                    Shape::Objects(o) => objects.extend(o),
                    Shape::Strings(s) => strings.extend(s),
                }
            }
            return if objects.is_empty() {
                Shape::Strings(strings)
            } else {
                Shape::Objects(objects)
            };
        }
    }
    if let Some(parts) = schema["allOf"].as_array() {
        let mut acc = vec![BTreeSet::new()];
        for part in parts {
            if let Shape::Objects(alts) = shape(doc, part) {
                acc = acc
                    .iter()
                    .flat_map(|a| alts.iter().map(move |b| a.union(b).cloned().collect()))
                    .collect();
            }
        }
        return Shape::Objects(acc);
    }
    let props = schema["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    Shape::Objects(vec![props])
}

#[test]
fn every_field_of_every_wire_type_is_in_its_schema() {
    let doc = doc();
    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    let samples = samples();
    for name in schemas.keys() {
        assert!(
            samples.contains_key(name.as_str()) || DOC_ONLY.contains(&name.as_str()),
            "schema {name} has no sample here: add one (every field set) to samples()"
        );
    }
    for (name, values) in &samples {
        let schema = schemas
            .get(*name)
            .unwrap_or_else(|| panic!("{name} is a wire type of the API but not in the document"));
        match shape(&doc, schema) {
            Shape::Strings(allowed) => {
                for v in values {
                    let v = v
                        .as_str()
                        .unwrap_or_else(|| panic!("{name}: {v} is not a string"));
                    assert!(
                        allowed.contains(v),
                        "{name}: value {v:?} missing from {allowed:?}"
                    );
                }
            }
            Shape::Objects(alts) => {
                for v in values {
                    let keys: BTreeSet<String> = v
                        .as_object()
                        .unwrap_or_else(|| panic!("{name}: {v} is not an object"))
                        .keys()
                        .cloned()
                        .collect();
                    assert!(
                        alts.contains(&keys),
                        "{name}: the type sends {keys:?}; the document has {alts:?}"
                    );
                }
                assert!(
                    alts.len() <= values.len(),
                    "{name}: the document has {} variants, samples() only {}",
                    alts.len(),
                    values.len()
                );
            }
        }
    }
}

#[test]
fn request_bodies_refuse_unknown_fields_as_the_server_does() {
    let doc = doc();
    let schemas = &doc["components"]["schemas"];
    for name in [
        "CreateSandboxRequest",
        "RunShellRequest",
        "ExecRequest",
        "NetworkSpec",
        "NetworkRule",
        "LabelSelector",
        "PackDiffRequest",
        "SnapshotRequest",
        "ForkRequest",
        "FunctionCallRequest",
        "FunctionBatchRequest",
        "Quota",
        "CreateProjectRequest",
        "CreateKeyRequest",
        "CreateBatchRequest",
        "CreateVolumeRequest",
    ] {
        assert_eq!(
            schemas[name]["additionalProperties"],
            json!(false),
            "{name} is deny_unknown_fields"
        );
    }
    // A field that must be sent is required; one with a default is not.
    assert_eq!(
        schemas["CreateSandboxRequest"]["required"],
        json!(["image"])
    );
    assert_eq!(schemas["RunShellRequest"]["required"], json!(["cmd"]));
}

// ---------------------------------------------------------------------------------------------
// The checked-in copy (read by people and by the Python SDK's type test).

const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");

#[test]
fn checked_in_copy_equals_the_generated_document() {
    let generated = format!("{}\n", document_json());
    if std::env::var_os("DSEC_BLESS_OPENAPI").is_some() {
        std::fs::write(CHECKED_IN, &generated).expect("write openapi.json");
        return;
    }
    let on_disk = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
    assert!(
        on_disk == generated,
        "{CHECKED_IN} is not the generated document; regenerate it with \
         `DSEC_BLESS_OPENAPI=1 cargo test --release -p dsec-apiserver --lib openapi`"
    );
}
