// Must not compile (__test__/types.test.cjs asserts the exact error): a
// finishReason that the API never returns.
import type { ChatResult } from '../../index.cjs'

export function finished(r: ChatResult): boolean {
  let reason: ChatResult['finishReason'] = r.finishReason
  reason = 'done'
  return reason === 'stop'
}
