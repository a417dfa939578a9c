//! Named persistent volumes (issue 18).

#![allow(dead_code)]

use dsec_wire::api::{CreateVolumeRequest, ErrorBody, VolumeInfo, VolumeList};
use utoipa::IntoParams;

use super::paths::ERRORS;

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct VolumePath {
    /// Volume name (`[a-z0-9][a-z0-9-]{0,62}`), unique within its project.
    name: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct ProjectQuery {
    /// Project owning the volume (default: the caller's home project).
    project: Option<String>,
}

/// Create a named volume: an ext4 file system of `size_mb` MiB kept on one node (writes past
/// the size fail with ENOSPC inside the sandboxes using it). A sandbox mounts it with
/// `volumes: {"/data": "name"}` and is placed on its node.
#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", operation_id = "createVolume",
    request_body = CreateVolumeRequest,
    responses(
        (status = 201, description = "The volume", body = VolumeInfo),
        (status = 409, description = "A volume of that name exists in the project", body = ErrorBody),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_volume() {}

/// The volumes of a project.
#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", operation_id = "listVolumes",
    params(ProjectQuery),
    responses(
        (status = 200, description = "The project's volumes", body = VolumeList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_volumes() {}

/// One volume, with the sandboxes that have it mounted (`used_by`).
#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes", operation_id = "getVolume",
    params(VolumePath, ProjectQuery),
    responses(
        (status = 200, description = "The volume", body = VolumeInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_volume() {}

/// Delete a volume and its data; refused with 409 (naming the sandboxes) while mounted.
#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes", operation_id = "deleteVolume",
    params(VolumePath, ProjectQuery),
    responses(
        (status = 204, description = "Deleted"),
        (status = 409, description = "Mounted by live sandboxes (named in the message)", body = ErrorBody),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn delete_volume() {}
