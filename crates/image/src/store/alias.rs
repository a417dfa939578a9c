//! Aliases: a second name for an image's layers (`dsec image alias NAME TARGET`).
//!
//! An alias is an image record of its own pointing at the target's layers (nothing is copied:
//! layers are shared and reference-counted by the index), with `parent` = the target and
//! `source` = `alias`. It is a name for the target as it is now: re-importing the target later
//! does not move the alias (alias it again).

use dsec_wire::api::ImageInfo;

use super::ImageStore;
use crate::{name, ImageError};

/// `source` of an alias record.
pub const ALIAS_SOURCE: &str = "alias";

impl ImageStore {
    /// Registers `alias` for the layers of `target` (replacing an image named `alias`).
    pub async fn alias(&self, alias: &str, target: &str) -> Result<ImageInfo, ImageError> {
        let alias = name::canonical(alias)?;
        let target = name::canonical(target)?;
        if alias == target {
            return Err(ImageError::Import {
                name: alias,
                message: "an alias must have another name than its target".into(),
            });
        }
        let layers = {
            let st = self.inner.lock();
            st.index
                .images
                .get(&target)
                .ok_or_else(|| ImageError::NotFound(target.clone()))?
                .layers
                .clone()
        };
        let info = self
            .register(
                &alias,
                layers,
                Vec::new(),
                Some(target.clone()),
                Some(ALIAS_SOURCE.into()),
            )
            .await?;
        tracing::info!(alias = %alias, target = %target, "image alias registered");
        Ok(info)
    }
}
