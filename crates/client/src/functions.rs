//! Function calls: one program on a pre-warmed worker, batches, and the node's warm pools.

use dsec_wire::api::{
    FunctionBatchRequest, FunctionBatchResult, FunctionCallRequest, FunctionCallResult,
    FunctionPoolList,
};
use reqwest::Method;

use crate::{json, Client, Result};

impl Client {
    /// `POST /v1/functions/call`: runs one program and waits for its result.
    pub async fn function_call(&self, req: &FunctionCallRequest) -> Result<FunctionCallResult> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "functions", "call"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `POST /v1/functions/batch`: runs several programs; results in request order.
    pub async fn function_batch(&self, req: &FunctionBatchRequest) -> Result<FunctionBatchResult> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "functions", "batch"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `GET /v1/functions/pools`: the warm pools of the node.
    pub async fn function_pools(&self) -> Result<FunctionPoolList> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "functions", "pools"])?))
                .await?,
        )
        .await
    }
}
