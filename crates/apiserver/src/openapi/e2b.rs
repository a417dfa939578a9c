//! The E2B-compatible front door (issue 19) and the TTL update it maps `timeout` onto.
//!
//! Only the entry points are described here: the whole E2B API under `/e2b` follows E2B's own
//! published description (the e2b SDKs' generated clients); `compat::e2b` lists what is served.

#![allow(dead_code)]

use dsec_wire::api::{ErrorBody, SandboxInfo, TtlUpdate};

use super::paths::ERRORS;

/// Change a sandbox's TTLs (E2B's `timeout`): absent fields stay, 0 removes one; the call
/// resets the idle clock.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/ttl", tag = "sandboxes",
    operation_id = "updateSandboxTtl",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = TtlUpdate,
    responses(
        (status = 200, description = "The sandbox with its new TTLs", body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn update_ttl() {}

/// E2B-compatible create (`POST /e2b/v2/sandboxes`, also `/e2b/sandboxes`): E2B's NewSandbox
/// body (`templateID` = a dsec image or alias, `timeout`, `autoPause`, `metadata`, `envVars`,
/// `allow_internet_access`, `network`); answers E2B's Sandbox (`sandboxID`,
/// `envdAccessToken`, ...). The key is sent as `X-API-Key` (or `Authorization: Bearer`); errors
/// are E2B's `{"code", "message"}`. Every other E2B call lives under `/e2b` too (see the README
/// section "Using the E2B SDK").
#[utoipa::path(post, path = "/e2b/v2/sandboxes", tag = "e2b",
    operation_id = "e2bCreateSandbox",
    request_body(content = Object, description = "E2B NewSandbox"),
    responses(
        (status = 201, description = "E2B Sandbox", body = Object),
        (status = "default", description = "E2B Error `{\"code\": status, \"message\"}` (shown here as dsec's ErrorBody for tooling)", body = ErrorBody),
    ))]
pub fn e2b_create_sandbox() {}

/// E2B-compatible list (`GET /e2b/v2/sandboxes?metadata=&state=&limit=&nextToken=`): E2B's
/// ListedSandbox array; the next page's token is the `x-next-token` header.
#[utoipa::path(get, path = "/e2b/v2/sandboxes", tag = "e2b",
    operation_id = "e2bListSandboxes",
    responses(
        (status = 200, description = "E2B ListedSandbox array", body = Object),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn e2b_list_sandboxes() {}
