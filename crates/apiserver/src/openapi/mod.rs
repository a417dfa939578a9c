//! The OpenAPI document served at `GET /openapi.json`, generated from the wire types.
//!
//! Schemas come from `ToSchema` derives on the types the servers (de)serialize
//! (`dsec_wire::api`, the IAM types), so a field added to a wire type is in the document
//! without anyone editing it. Operations are the `#[utoipa::path]` descriptions in [`paths`],
//! one per (method, path) that [`crate::routes::v1_routes`] and
//! [`crate::routes::public_routes`] register; the tests below fail when a registered route, a
//! wire field or an error code is missing from the document.

mod membership;

mod batches;

mod e2b;
mod paths;
mod ports;
mod processes;
mod volumes;

use std::sync::OnceLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// Sandbox routes the edge serves that reach it through the apiserver's
/// `/v1/sandboxes/{id}/{*rest}` pass-through (they have no route of their own here).
pub const EDGE_PASS_THROUGH: &[(&str, &str)] = &[
    ("post", "/v1/sandboxes/{id}/pack_diff"),
    ("post", "/v1/sandboxes/{id}/snapshot"),
    ("get", "/v1/sandboxes/{id}/network"),
    ("put", "/v1/sandboxes/{id}/network"),
    ("post", "/v1/sandboxes/{id}/pause"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("get", "/v1/sandboxes/{id}/trajectory"),
    ("get", "/v1/sandboxes/{id}/trajectory/last_step"),
    ("get", "/v1/sandboxes/{id}/trajectory/blobs/{digest}"),
    ("post", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes/{pid}"),
    ("get", "/v1/sandboxes/{id}/processes/{pid}/output"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/wait"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/stdin"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/signal"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/kill"),
    ("post", "/v1/sandboxes/{id}/files/rename"),
    ("get", "/v1/sandboxes/{id}/watch"),
    ("get", "/v1/sandboxes/{id}/metrics"),
    ("put", "/v1/sandboxes/{id}/ttl"),
];

#[derive(OpenApi)]
#[openapi(
    info(
        title = "dsec API",
        version = "1",
        description = "Public API of dsec, an elastic sandbox platform. Every /v1 route needs \
            `Authorization: Bearer <API key>`. JSON request bodies are limited to 524288 bytes \
            (413 beyond). Every error is an `ErrorBody` with a 4xx status (the caller must fix \
            something) or a 5xx one (server side); `ErrorDetail.code` is one of `ErrorCode`.",
        license(name = "Apache-2.0")
    ),
    servers((url = "/", description = "This apiserver")),
    security(("apiKey" = [])),
    modifiers(&ApiKeyScheme),
    paths(
        paths::create_sandbox,
        paths::list_sandboxes,
        paths::get_sandbox,
        paths::stop_sandbox,
        paths::run_shell,
        paths::exec,
        paths::close_session,
        paths::write_file,
        paths::read_file,
        paths::remove_file,
        paths::list_files,
        paths::stat_file,
        paths::mkdir,
        paths::tty,
        paths::pack_diff,
        paths::snapshot,
        paths::fork,
        ports::create_port_url,
        ports::proxy_get,
        ports::proxy_post,
        ports::proxy_put,
        ports::proxy_delete,
        paths::get_network,
        paths::set_network,
        paths::pause,
        paths::resume,
        paths::get_trajectory,
        paths::get_last_step,
        paths::get_trajectory_blob,
        paths::list_images,
        paths::import_image,
        paths::image_action,
        paths::remove_image,
        paths::list_microvm_templates,
        paths::remove_microvm_templates,
        paths::list_nodes,
        membership::join_node,
        membership::node_heartbeat,
        membership::cordon_node,
        membership::uncordon_node,
        membership::drain_node,
        membership::create_join_token,
        paths::cluster_view,
        paths::list_projects,
        paths::create_project,
        paths::set_project_quota,
        paths::create_key,
        paths::revoke_key,
        paths::job_op,
        batches::create_batch,
        batches::get_batch,
        batches::cancel_batch,
        paths::function_call,
        paths::function_batch,
        paths::function_pools,
        paths::sandboxfusion_run_code,
        paths::sandboxfusion_run_jupyter,
        paths::openapi,
        paths::healthz,
        paths::metrics,
        processes::start_process,
        processes::list_processes,
        processes::get_process,
        processes::process_output,
        processes::wait_process,
        processes::process_stdin,
        processes::signal_process,
        processes::kill_process,
        processes::rename_file,
        processes::watch_files,
        processes::sandbox_metrics,
        volumes::create_volume,
        volumes::list_volumes,
        volumes::get_volume,
        volumes::delete_volume,

        e2b::update_ttl,
        e2b::e2b_create_sandbox,
        e2b::e2b_list_sandboxes,
    ),
    components(schemas(
        dsec_wire::api::EndReason,
        dsec_wire::api::ErrorCode,
        dsec_wire::api::TtyControl,
        dsec_wire::api::NodeStatus,
        dsec_wire::api::QueueReport,
        // A query parameter's enum: utoipa refers to it but does not collect it by itself.
        paths::ImportFormat,
        paths::JobOp,
    )),
    tags(
        (name = "sandboxes", description = "Create, inspect, stop, pause and resume sandboxes"),
        (name = "commands", description = "Shell sessions, exec and the terminal"),
        (name = "files", description = "Files inside a sandbox"),
        (name = "network", description = "A sandbox's network policy"),
        (name = "trajectory", description = "A sandbox's call log and fast-forward"),
        (name = "images", description = "Images and microVM templates"),
        (name = "cluster", description = "Nodes and the cluster view"),
        (name = "iam", description = "Projects, quotas and API keys (admin)"),
        (name = "jobs", description = "Operations on every sandbox of a job (by labels)"),
        (name = "batches", description = "Many sandboxes of one shape, placed as capacity frees (create_many)"),

        (name = "e2b", description = "The E2B-compatible API under /e2b (issue 19)"),
        (name = "functions", description = "Function calls on pre-warmed workers"),
        (name = "ports", description = "Exposed ports: reach a server inside a sandbox"),
        (name = "volumes", description = "Named persistent volumes of a project"),
        (name = "service", description = "Unauthenticated service routes"),
    )
)]
struct ApiDoc;

/// Adds the bearer-key security scheme the `security` requirement names.
struct ApiKeyScheme;

impl Modify for ApiKeyScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "apiKey",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("API key `dsk_...`"))
                    .build(),
            ),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as JSON, rendered once.
pub fn document_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        document()
            .to_pretty_json()
            .unwrap_or_else(|e| format!("{{\"error\": \"openapi document: {e}\"}}"))
    })
}

#[cfg(test)]
mod tests;
