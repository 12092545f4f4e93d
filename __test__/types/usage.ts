// Compiled with `strict` by __test__/types.test.cjs (never run): a real
// program against the published types. It must compile without errors.
import { Lfm2Model, mlxInfo, type ChatMessage, type ChatResult, type FunctionTool, type LoadProgress, type ModelInfo } from '../../index.cjs'
import { listen, type ServerOptions, type ListenOptions } from '../../lib/server.cjs'

const tools: FunctionTool[] = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'The weather in a city',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    },
  },
]

async function main(dir: string): Promise<void> {
  const seen: LoadProgress[] = []
  const model = await Lfm2Model.load(dir, {
    dtype: 'bfloat16',
    kvCache: 'affine8',
    decodePath: 'eager',
    device: 'cpu',
    useBlockPagedCache: false,
    contextLength: 4096,
    onProgress: (p) => {
      seen.push(p)
      const done: boolean = p.phase === 'ready' || p.loadedBytes === p.totalBytes
      void done
    },
  })
  const info: ModelInfo = model.info()
  const path: 'compiled' | 'eager' = info.decodePath
  const kind: 'paged' | 'flat' | 'quantized' = info.cacheKind
  const backend: 'cpu' | 'cuda' | 'metal' = mlxInfo().backend
  console.log(path, kind, backend, info.device, info.kvCache, info.dtype)

  // A prompt cache that survives restarts.
  const fingerprint: string = info.fingerprint
  const session = model.createSession({ system: 'Be brief.' })
  await session.send('Hello')
  const saved: { tokens: number; bytes: number } = await session.save('/tmp/chat.session')
  const restored = await model.loadSession('/tmp/chat.session', { defaults: { maxTokens: 32 } })
  const cached: number = (await restored.send('And then?')).metrics.cachedTokens
  const disk = await Lfm2Model.load(dir, { prefixCacheDir: '/tmp/prefix-cache', prefixCacheDiskMb: 512 })
  const stats = await disk.cacheStats()
  const diskHits: number | undefined = stats?.diskHits
  console.log(fingerprint, saved.tokens, cached, diskHits, stats?.diskBytes, stats?.diskEvictions, stats?.diskMisses)

  const messages: ChatMessage[] = [{ role: 'user', content: 'What is the weather in Paris?' }]
  const r: ChatResult = await model.chat(messages, { tools, maxTokens: 64, signal: AbortSignal.timeout(10_000) })
  switch (r.finishReason) {
    case 'tool_calls':
      for (const call of r.toolCalls ?? []) {
        const args: unknown = JSON.parse(call.function.arguments)
        const t: 'function' = call.type
        messages.push({ role: 'assistant', content: r.text, toolCalls: [call] })
        messages.push({ role: 'tool', toolCallId: call.id, content: JSON.stringify({ args, t }) })
      }
      break
    case 'stop':
    case 'length':
    case 'abort':
    case 'constraint':
      console.log(r.text)
      break
    default: {
      // Every finishReason is handled above: this only compiles while the
      // union is exactly those five.
      const never: never = r.finishReason
      throw new Error(never)
    }
  }
  const forced = await model.chat(messages, { tools, toolChoice: { name: 'get_weather' }, logprobs: true, topLogprobs: 2 })
  for (const e of forced.logprobs ?? []) console.log(e.token, e.text, e.logprob, e.topLogprobs.map((t) => t.logprob))
  const json = await model.generate('Data:', { jsonSchema: { type: 'object' }, presencePenalty: 0.5, logitBias: { '42': -100 } })
  const other = await model.generate([1, 2], { regex: '[0-9]+', grammar: undefined, toolChoice: 'none', frequencyPenalty: 0.1 })
  console.log(json.text, other.text)
  for await (const ev of model.chatStream(messages, { tools })) {
    if (ev.type === 'text') process.stdout.write(ev.text)
    else console.log(ev.result.finishReason)
  }

  const options: ServerOptions = {
    model,
    modelId: 'lfm2',
    apiKey: 'a-long-enough-key',
    cors: 'https://example.com',
    maxPromptTokens: 2048,
    headersTimeout: 10_000,
    requestTimeout: 60_000,
    keepAliveTimeout: 5_000,
    log: (line) => console.error(line),
  }
  const where: ListenOptions = { port: 0, host: '127.0.0.1', maxConnections: 16, requestTimeout: 30_000 }
  const { server, url } = await listen(options, where)
  console.log(url)
  server.close()
  model.close()
}

void main(process.argv[2] ?? '.')
