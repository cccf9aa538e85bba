//! Deleting expired rows in bounded batches, each its own statement, so that no sweep holds a
//! long lock.

use std::future::Future;

use crate::Error;

/// Runs `delete(limit)` until a batch removes fewer than `limit` rows; returns how many were
/// removed in all, and the error that ended the sweep early, if one did.
///
/// A `limit` of 0 is taken as 1: a batch of 0 never comes back short, and the sweep would never
/// end.
pub(crate) async fn delete_in_batches<F, Fut>(limit: usize, mut delete: F) -> (u64, Option<Error>)
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<u64, Error>>,
{
    let limit = limit.max(1);
    let mut removed = 0;
    loop {
        match delete(limit).await {
            Ok(count) => {
                removed += count;
                if count < limit as u64 {
                    return (removed, None);
                }
            }
            Err(error) => return (removed, Some(error)),
        }
    }
}
