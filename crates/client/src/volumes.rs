//! Named persistent volumes (issue 18): create, list, inspect, delete. A sandbox mounts them
//! with [`dsec_wire::api::CreateSandboxRequest::volumes`].

use dsec_wire::api::{CreateVolumeRequest, VolumeInfo, VolumeList};
use reqwest::Method;

use crate::{check, json, Client, Result};

impl Client {
    /// Creates volume `name` of `size_mb` MiB in `project` (default: the key's project).
    pub async fn create_volume(
        &self,
        name: &str,
        size_mb: u64,
        project: Option<&str>,
    ) -> Result<VolumeInfo> {
        let body = CreateVolumeRequest {
            name: name.to_string(),
            size_mb,
            project: project.map(str::to_string),
            node: None,
        };
        let (b, u) = self.request(Method::POST, self.url(&["v1", "volumes"])?);
        json(self.send((b.json(&body), u)).await?).await
    }

    fn volume_url(&self, name: Option<&str>, project: Option<&str>) -> Result<url::Url> {
        let mut u = match name {
            Some(n) => self.url(&["v1", "volumes", n])?,
            None => self.url(&["v1", "volumes"])?,
        };
        if let Some(p) = project {
            u.query_pairs_mut().append_pair("project", p);
        }
        Ok(u)
    }

    /// The volumes of `project` (default: the key's project).
    pub async fn list_volumes(&self, project: Option<&str>) -> Result<Vec<VolumeInfo>> {
        let u = self.volume_url(None, project)?;
        let list: VolumeList = json(self.send(self.request(Method::GET, u)).await?).await?;
        Ok(list.volumes)
    }

    /// One volume, with the sandboxes using it.
    pub async fn volume(&self, name: &str, project: Option<&str>) -> Result<VolumeInfo> {
        let u = self.volume_url(Some(name), project)?;
        json(self.send(self.request(Method::GET, u)).await?).await
    }

    /// Deletes a volume and its data (refused while a sandbox has it mounted).
    pub async fn delete_volume(&self, name: &str, project: Option<&str>) -> Result<()> {
        let u = self.volume_url(Some(name), project)?;
        check(self.send(self.request(Method::DELETE, u)).await?).await?;
        Ok(())
    }
}
