//! Extractors whose rejections are our [`ErrorBody`](dsec_wire::api::ErrorBody) answers
//! (bad JSON, wrong content type, unknown fields, bad query or path), not axum's plain text.

use axum::extract::{FromRequest, FromRequestParts};

use crate::error::EdgeError;

/// `axum::Json` with [`EdgeError`] rejections (serde's message names the field and position).
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(EdgeError))]
pub struct ApiJson<T>(pub T);

/// `axum::extract::Path` with [`EdgeError`] rejections.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(EdgeError))]
pub struct ApiPath<T>(pub T);

/// `axum::extract::Query` with [`EdgeError`] rejections.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(EdgeError))]
pub struct ApiQuery<T>(pub T);
