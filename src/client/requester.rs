//! How the crate's own requests (its watches and lists) go out: through a `kube::Client`, or
//! straight through the service stack a cluster's client is made of ([`Requester`]), an API
//! server's refusal made a [`kube::Error::Api`] either way.

use std::pin::Pin;

use bytes::Bytes;
use http_body_util::BodyExt;
use kube::core::Status;
use tower::{BoxError, ServiceExt};

/// A response body, whatever stack it came through.
pub(crate) type ResponseBody =
    Pin<Box<dyn http_body::Body<Data = Bytes, Error = BoxError> + Send + 'static>>;

/// A cluster's service stack, cloned per request.
pub(crate) type RawService = tower::util::BoxCloneSyncService<
    http::Request<kube::client::Body>,
    http::Response<ResponseBody>,
    BoxError,
>;

/// How a watch sends its requests.
#[derive(Clone)]
pub(crate) enum Requester {
    /// Through a client (one given to the cluster, or one of kube's own stacks).
    Client(kube::Client),
    /// Through the service stack the cluster's client is made of, without a client.
    Service(RawService),
}

impl From<kube::Client> for Requester {
    fn from(client: kube::Client) -> Self {
        Requester::Client(client)
    }
}

impl Requester {
    /// Sends `request`; a response whose status is an error becomes [`kube::Error::Api`], as
    /// kube's own requests do.
    pub(crate) async fn send(
        &self,
        request: http::Request<Vec<u8>>,
    ) -> kube::Result<http::Response<ResponseBody>> {
        let request = request.map(kube::client::Body::from);
        let response = match self {
            Requester::Client(client) => client
                .send(request)
                .await?
                .map(|body| Box::pin(body.map_err(box_kube_error)) as ResponseBody),
            Requester::Service(service) => service
                .clone()
                .oneshot(request)
                .await
                .map_err(service_error)?,
        };
        refused(response).await
    }
}

/// A body error of kube's client as the stack's own: kube wraps them in
/// [`kube::Error::Service`], which the reader would wrap again.
fn box_kube_error(error: kube::Error) -> BoxError {
    match error {
        kube::Error::Service(inner) => inner,
        other => Box::new(other),
    }
}

/// A stack's error as kube's client reports it: kube's own error as it is, hyper's as
/// [`kube::Error::HyperError`], anything else as [`kube::Error::Service`].
fn service_error(error: BoxError) -> kube::Error {
    match error.downcast::<kube::Error>() {
        Ok(error) => *error,
        Err(error) => match error.downcast::<hyper::Error>() {
            Ok(error) => kube::Error::HyperError(*error),
            Err(error) => kube::Error::Service(error),
        },
    }
}

/// `response`, or the API server's refusal in it as [`kube::Error::Api`] (a body that is not
/// a `Status`, from a proxy say, becomes one carrying its text and the HTTP code).
async fn refused(
    response: http::Response<ResponseBody>,
) -> kube::Result<http::Response<ResponseBody>> {
    let code = response.status();
    if !code.is_client_error() && !code.is_server_error() {
        return Ok(response);
    }
    let bytes = collect(response.into_body()).await?;
    if let Ok(status) = serde_json::from_slice::<Status>(&bytes) {
        return Err(kube::Error::Api(status.boxed()));
    }
    let text = String::from_utf8(bytes.to_vec()).map_err(kube::Error::FromUtf8)?;
    Err(kube::Error::Api(
        Status::failure(text.trim(), "Failed to parse error data")
            .with_code(code.as_u16())
            .boxed(),
    ))
}

/// All of `body`.
pub(crate) async fn collect(body: ResponseBody) -> kube::Result<Bytes> {
    body.collect()
        .await
        .map(|collected| collected.to_bytes())
        .map_err(kube::Error::Service)
}
